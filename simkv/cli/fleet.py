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


def fleet(
    scenario: Path = typer.Argument(..., help="Scenario YAML with a cluster: section and SLOs."),
    rate: float = typer.Option(..., "--rate", help="Requests per second (as capacity defines it)."),
    set_: list[str] = typer.Option([], "--set", help="KEY=VALUE override (repeatable)."),
    gpu_price: list[str] = typer.Option([], "--gpu-price",
                                        help="GPU=USD_PER_HOUR (repeatable); default the specs'."),
    gpu_budget: int = typer.Option(32, "--gpu-budget",
                                   help="P/D: most GPUs (prefill + decode) to try."),
    backend: str = typer.Option("local", "--backend", help="local | dask"),
    dask_address: Optional[str] = typer.Option(None, "--dask-address",
                                               help="dask scheduler; default a LocalCluster"),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> int:
    """The smallest fleet of the scenario's pools that meets its SLOs at --rate, with the
    largest failing fleet as evidence, GPU count and cost."""
    from simkv.config.scenario import load_scenario, parse_set
    from simkv.errors import InputError

    from simkv.limits import check_number

    if backend not in ("local", "dask"):
        raise InputError(f"--backend: {backend!r} is not one of local, dask")
    check_number(rate, "--rate", "--rate")
    check_number(gpu_budget, "--gpu-budget", "--gpu-budget")
    find = require("simkv.whatif.fleet", "find_fleet", "fleet")
    from simkv.whatif.fleet import parse_gpu_prices

    scn = load_scenario(scenario, parse_set(set_))
    result = find(scn, rate, gpu_prices=parse_gpu_prices(gpu_price), gpu_budget=gpu_budget,
                  backend=backend, dask_address=dask_address)
    if as_json:
        print_json(result)
        return 0
    pools = ", ".join(f"{name} x {n}" for name, n in result["pools"].items())
    slo = ", ".join(f"{k} <= {v:g}" for k, v in result["slo"].items())
    at = result["at_answer"]
    print(f"{scn.name} at {rate:g} requests/s (workload.time_scale {result['rate_scale']:.4g}),"
          f" SLOs {slo}:")
    print(f"  smallest fleet: {result['replicas']} replicas ({pools}), {result['gpus']} GPUs, "
          f"${result['cost_per_hour_usd']:.2f}/h, "
          + (f"${result['cost_per_million_output_tokens_usd']:.3f} per million output tokens"
             if result["cost_per_million_output_tokens_usd"] is not None else "no output"))
    print(f"  there: TTFT p90 {fmt(at['ttft_p90_s'])} s, TPOT p90 {fmt(at['tpot_p90_s'])} s, "
          f"goodput {fmt(at['goodput_requests_per_s'])} requests/s")
    largest = result["largest_failing"]
    if largest is None:
        print("  (one replica is enough: no smaller fleet to fail)")
    else:
        fails = ", ".join(f"{name} x {n}" for name, n in largest["pools"].items())
        print(f"  largest failing: {largest['replicas']} replicas ({fails}): {largest['reason']}")
    print(f"  {result['simulations']} simulations; prices: " + ", ".join(
        f"{g} ${p:g}/h" for g, p in result["gpu_price_usd_per_hour"].items()))
    return 0
