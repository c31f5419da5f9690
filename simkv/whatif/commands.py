"""Bodies of `simkv sweep`, `simkv capacity` and `simkv check` (the CLI wires its options here).

Each returns the exit code (0 ok, 1 a point, check or expectation failed) and raises InputError
for bad input (the CLI prints `error: ...` and exits 2).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from simkv.config.scenario import load_scenario, parse_set
from simkv.engine.results import atomic_write_text

SWEEP_TABLE = {"kv_utilization_mean": "KV util", "internal_fragmentation_mean": "int. frag",
               "running_mean": "running", "running_peak": "peak", "preemptions": "preempt",
               "ttft_s.p90": "TTFT p90 s", "tpot_s.p90": "TPOT p90 s",
               "goodput_requests_per_s": "goodput/s", "slo_met": "SLOs met"}


def sweep_command(scenario_path: str | Path, grid: list[str], sets: list[str],
                  backend: str = "local", dask_address: Optional[str] = None,
                  out_dir: Optional[str | Path] = None, resume: bool = False,
                  workers: Optional[int] = None) -> int:
    """`simkv sweep SCENARIO --grid KEY=V1,V2 ... [--set ...] [--backend local|dask]
    [--dask-address ADDR] [--out DIR] [--resume] [--workers N]`.

    Writes OUT/sweep.csv, OUT/points/*.json and OUT/plots/*.png|svg (default OUT:
    results/<scenario name>-sweep). Returns 1 if a point failed (the others are kept; --resume
    runs the failed ones again), else 0.
    """
    from simkv.whatif.plots import plot_sweep
    from simkv.whatif.sweep import parse_grid, run_sweep

    parsed_grid = parse_grid(grid)
    overrides = parse_set(sets)
    if out_dir is None:
        out_dir = Path("results") / f"{load_scenario(scenario_path, overrides).name}-sweep"
    out_dir = Path(out_dir)
    failed = []

    def on_error(point, error):
        failed.append(point)
        where = " ".join(f"{k}={v}" for k, v in point.items())
        print(f"point {where} failed: {type(error).__name__}: {error}", file=sys.stderr)

    frame = run_sweep(scenario_path, parsed_grid, out_dir, sets=overrides, backend=backend,
                      dask_address=dask_address, workers=workers, resume=resume,
                      progress=sys.stderr.isatty(), on_error=on_error)
    plots = plot_sweep(frame, list(parsed_grid), out_dir / "plots")
    _print_sweep(frame, list(parsed_grid))
    mixed = mixed_cost_model_kinds(frame)
    if mixed:
        print(f"caveat: {mixed}")
    print(f"{len(frame)} point(s) in {out_dir / 'sweep.csv'}; plots in {out_dir / 'plots'} "
          f"({len(plots)} files)")
    if failed:
        print(f"{len(failed)} point(s) failed; run again with --resume to retry them",
              file=sys.stderr)
        return 1
    return 0


def mixed_cost_model_kinds(frame) -> str | None:
    """A sentence when the points are timed by different kinds of cost model (a profile for
    one GPU, the roofline for another): their differences then mix hardware with the models'
    errors. None when every point has one kind."""
    if "cost_model" not in frame.columns:
        return None
    names = sorted(set(frame["cost_model"].dropna().astype(str)))
    kinds = {("profile" if n.startswith("profile:") else "roofline") for n in names}
    if len(kinds) < 2:
        return None
    return ("the points are timed by different kinds of cost model (" + ", ".join(names)
            + "): their differences mix the GPUs with the models' errors; for one kind, add "
            "--set cost_model=roofline")


def _print_sweep(frame, grid_keys: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sweep")
    columns = grid_keys + [c for c in SWEEP_TABLE if c in frame.columns]
    for column in columns:
        table.add_column(SWEEP_TABLE.get(column, column.rsplit(".", 1)[-1]), justify="right")
    for _, row in frame.iterrows():
        table.add_row(*(_fmt(row[c]) for c in columns))
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def capacity_command(scenario_path: str | Path, sets: list[str], replicates: int = 1,
                     tolerance: float = 0.02, as_json: bool = False,
                     resample: str = "bootstrap") -> int:
    """`simkv capacity SCENARIO [--set ...] [--replicates K] [--tolerance F] [--json]`.

    Prints the highest arrival rate meeting every SLO (JSON keys: max_rate_rps, rate_scale,
    slo, slo_attainment, tolerance, verified, probes, summary, and ci with replicates > 1).
    """
    from simkv.whatif.capacity import find_capacity

    scenario = load_scenario(scenario_path, parse_set(sets))
    with _progress(f"capacity of {scenario.name}") as on_progress:
        result = find_capacity(scenario, tolerance=tolerance, replicates=replicates,
                               on_progress=on_progress, resample=resample)
    if as_json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    slo = ", ".join(f"{k} <= {v:g}" for k, v in result.slo.items())
    at, above = result.at_rate, result.above
    print(f"{scenario.name} ({scenario.model.name} on {scenario.gpu.name}): "
          f"{result.max_rate_rps:.4g} requests/s meets every SLO "
          f"(workload.time_scale {result.rate_scale:.4g}; bracket within {tolerance:.0%})")
    print(f"  SLOs: {slo}; per-request SLOs need {result.attainment:.0%} of requests to meet "
          "all of them (docs/whatif.md)")
    print(f"  at {at.rate_rps:.4g} requests/s: met" + _attained(at.verdict))
    print(f"  at {above.rate_rps:.4g} requests/s (+10%): fails: {above.verdict.describe()}")
    s = result.summary
    print(f"  at capacity: TTFT p90 {_fmt(s['ttft_s']['p90'])} s, TPOT p90 "
          f"{_fmt(s['tpot_s']['p90'])} s, mean running {_fmt(s['running_mean'])}, KV "
          f"utilisation {_fmt(s['kv_utilization_mean'])}, preemptions {s['preemptions']}")
    if result.ci is not None:
        ci = result.ci
        print(f"  over {len(ci['replicates'])} workloads (this scenario's first): "
              + ", ".join(f"{r:.4g}" for r in ci["replicates"])
              + f" requests/s, from {ci['min']:.4g} to {ci['max']:.4g}; their mean "
              f"{ci['mean']:.4g} (95% confidence interval of the mean {ci['low']:.4g} to "
              f"{ci['high']:.4g}: where the average lies, not one day's traffic)")
    print(f"  {len(result.probes)} simulations: "
          + ", ".join(f"{r:.4g}{'+' if m else '-'}" for r, m in result.probes))
    plan = result.planning()
    print(f"plan with {plan['rate_rps']:.4g} requests/s: {plan['basis']}")
    return 0


class _progress:
    """A spinner on stderr naming each finished simulation, only when stderr is a terminal;
    yields the callback (None when there is no terminal)."""

    def __init__(self, label: str):
        self.label = label
        self.status = None

    def __enter__(self):
        if not sys.stderr.isatty():
            return None
        from rich.console import Console
        self.status = Console(stderr=True).status(f"{self.label}: first simulation ...")
        self.status.__enter__()
        return lambda text: self.status.update(f"{self.label}: {text}")

    def __exit__(self, *exc):
        if self.status is not None:
            self.status.__exit__(*exc)
        return False


def _attained(verdict) -> str:
    return "" if verdict.attainment is None else f" ({verdict.attainment:.1%} of requests)"


def check_command(checks_path: str | Path, junit_path: Optional[str | Path] = None) -> int:
    """`simkv check CHECKS.yaml [--junit FILE]`: 0 if every expectation holds, 1 if one fails.

    Prints PASS/FAIL per check and, for each failed expectation, its key, bound and value.
    """
    from simkv.whatif.checks import check_keys, junit_xml, load_checks, run_check

    checks_path = Path(checks_path)
    checks = load_checks(checks_path)
    for check in checks:
        check_keys(check, str(checks_path))
    results = []
    for check in checks:
        result = run_check(check)
        results.append(result)
        print(f"{'PASS' if result.passed else 'FAIL'}  {check.name}  ({result.seconds:.1f} s)")
        for line in result.failed:
            print(f"      {line}")
        sys.stdout.flush()
    failed = sum(not r.passed for r in results)
    print(f"{len(results)} check(s): {len(results) - failed} passed, {failed} failed")
    if junit_path is not None:
        atomic_write_text(Path(junit_path), junit_xml(results, checks_path.name))
    return 1 if failed else 0
