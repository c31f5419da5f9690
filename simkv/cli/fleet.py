"""Fleet parts of the command line: a fleet run's terminal summary (a table per replica) and
`simkv fleet` (the smallest fleet that meets the scenario's SLOs at a rate)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from simkv.cli.common import fmt, print_json, print_summary, require

FLEET_ONLY = ("pools", "replicas", "router", "kv_transfer")
REPLICA_COLUMNS = [("requests", "requests_total"), ("TTFT p90 s", ("ttft_s", "p90")),
                   ("TPOT p90 s", ("tpot_s", "p90")), ("KV util", "kv_utilization_mean"),
                   ("running", "running_mean"), ("preempt", "preemptions"),
                   ("prefix hit", "prefix_cache_hit_ratio")]


def _value(row: dict, key):
    if isinstance(key, tuple):
        return (row.get(key[0]) or {}).get(key[1])
    return row.get(key)


def print_fleet_summary(summary: dict, title: str) -> None:
    """The fleet's totals as a run's summary, then one row per replica and the router's
    figures."""
    from rich.table import Table

    print_summary({k: v for k, v in summary.items() if k not in FLEET_ONLY}, title)
    table = Table(title="replicas")
    table.add_column("replica", style="bold")
    table.add_column("role")
    table.add_column("gpu")
    for name, _ in REPLICA_COLUMNS:
        table.add_column(name, justify="right")
    for row in summary["replicas"]:
        table.add_row(row["name"], row["role"], row["gpu"],
                      *(fmt(_value(row, key)) for _, key in REPLICA_COLUMNS))
    import sys
    from rich.console import Console
    out = Console(width=None if sys.stdout.isatty() else 160)
    out.print(table)
    router = summary["router"]
    out.print(f"router {router['policy']} (refresh {router['refresh_s']:g} s): prefix-cache hit "
              f"ratio {fmt(router['prefix_cache_hit_ratio'])}, load imbalance (busy time, max/"
              f"mean) {fmt(router['load_imbalance'])}, requests max/mean "
              f"{fmt(router['requests_imbalance'])}")
    if "kv_transfer" in summary:
        kv = summary["kv_transfer"]
        out.print(f"KV transfers over {kv['link']}: {kv['transfers']:,}, mean "
                  f"{fmt(kv['kv_transfer_s']['mean'])} s, p90 {fmt(kv['kv_transfer_s']['p90'])} s;"
                  f" waiting for decode room p90 {fmt(kv['handoff_wait_s']['p90'])} s")
