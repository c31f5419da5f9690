"""What-if commands: `simkv sweep`, `simkv capacity`, `simkv check` (simkv.whatif does the work)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from simkv.cli.common import require
from simkv.errors import InputError


def sweep(
    scenario: Path = typer.Argument(..., help="Scenario YAML."),
    grid: list[str] = typer.Option(..., "--grid", help="KEY=V1,V2,... (repeatable)."),
    set_: list[str] = typer.Option([], "--set", help="KEY=VALUE applied to every point."),
    backend: str = typer.Option("local", "--backend", help="local (process pool) | dask"),
    dask_address: Optional[str] = typer.Option(None, "--dask-address",
                                               help="dask scheduler; default a LocalCluster"),
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder."),
    resume: bool = typer.Option(False, "--resume", help="Skip points already in sweep.csv."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Parallel points."),
) -> int:
    """What-if grid over scenario keys; one row per point in sweep.csv, written as points finish."""
    if backend not in ("local", "dask"):
        raise InputError(f"--backend: {backend!r} is not one of local, dask")
    sweep_command = require("simkv.whatif.commands", "sweep_command", "sweep")
    return sweep_command(scenario, grid, set_, backend=backend, dask_address=dask_address,
                         out_dir=out, resume=resume, workers=workers)


def capacity(
    scenario: Path = typer.Argument(..., help="Scenario YAML with an slo: section."),
    set_: list[str] = typer.Option([], "--set", help="KEY=VALUE override (repeatable)."),
    replicates: int = typer.Option(1, "--replicates", help="Workloads to search: the scenario's, then K-1 reseeded or resampled ones."),
    tolerance: float = typer.Option(0.02, "--tolerance", help="Relative bisection tolerance."),
    resample: str = typer.Option(
        "bootstrap", "--resample",
        help="How a trace's replicates are made: bootstrap (block bootstrap of the window) or "
             "windows (the next workload.limit requests, and the next ...)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> int:
    """Highest request rate (by scaling inter-arrival times) that meets every SLO, and the
    rate to plan with."""
    from simkv.limits import check_number

    check_number(replicates, "--replicates", "--replicates")
    check_number(tolerance, "--tolerance", "--tolerance")
    capacity_command = require("simkv.whatif.commands", "capacity_command", "capacity")
    return capacity_command(scenario, set_, replicates=replicates, tolerance=tolerance,
                            as_json=as_json, resample=resample)


def check(
    checks: Path = typer.Argument(..., help="Checks YAML."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Write JUnit XML here."),
) -> int:
    """Sizing assertions for CI: exit 0 when all hold, 1 when one fails."""
    check_command = require("simkv.whatif.commands", "check_command", "check")
    return check_command(checks, junit)
