"""`simkv fit`: cost models from measurements, offline (CPU).

    simkv fit PROFILE_DIR [--out DIR] [--json]     the step-cost model (fit.json); short for
                                                   `simkv fit profile PROFILE_DIR`
    simkv fit shared-reads PROBE_DIR... --profile DIR [--out FILE]   shared_reads.json
    simkv fit clock PROBE_DIR... --model M --out FILE                clock.json
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from simkv.cli.common import (call_main, console, flag, fmt, print_json, require,
                              require_first, with_default_command)

fit_app = typer.Typer(
    cls=with_default_command("profile"), no_args_is_help=True,
    help="Fit cost models to measurements. `simkv fit PROFILE_DIR` is short for "
         "`simkv fit profile PROFILE_DIR`.")


@fit_app.command("profile")
def fit_profile_dir(
    profile_dir: Path = typer.Argument(..., help="A profile folder with raw CSVs."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where fit.json goes (default: DIR)."),
    as_json: bool = typer.Option(False, "--json", help="Print the fit as JSON."),
) -> None:
    """Fit the step-cost model to a profile's raw measurements (fit.json)."""
    fit_profile = require("simkv.fitting.fit", "fit_profile", "fit")
    result = fit_profile(profile_dir, out=out)
    if as_json:
        print_json(result)
        return
    print_fit(result, out or profile_dir)


def print_fit(result: dict, out_dir: Path) -> None:
    """One line: where fit.json went, its held-out error and its block sizes."""
    err = result.get("holdout_error", {})
    console().print(f"fit written to {Path(out_dir) / 'fit.json'}; held-out error "
                    f"median {fmt(err.get('median'))}, p95 {fmt(err.get('p95'))}; block sizes "
                    f"{result.get('block_sizes')}")


@fit_app.command("shared-reads")
def fit_shared_reads(
    probe_dirs: list[Path] = typer.Argument(..., help="Shared-blocks probe folders "
                                            "(research/shared_blocks.py)."),
    profile: Path = typer.Option(..., "--profile", help="Profile folder (its fit.json)."),
    out: Optional[Path] = typer.Option(None, "--out",
                                       help="Default: PROFILE/shared_reads.json."),
) -> int:
    """Fit the share of an HBM read that a repeated decode read of a shared block saves."""
    main = require_first([("simkv.fitting.shared_reads", "main"),
                          ("simkv.costmodel.shared_reads", "main")], "fit shared-reads")
    return call_main(main, [*map(str, probe_dirs), "--profile", str(profile), *flag("--out", out)])


@fit_app.command("clock")
def fit_clock(
    probe_dirs: list[Path] = typer.Argument(..., help="Clock probe folders "
                                            "(research/clock_probe.py)."),
    model: str = typer.Option(..., "--model", help="Bundled model name or config.json path."),
    out: Path = typer.Option(..., "--out", help="clock.json to write."),
) -> int:
    """Fit the GPU clock-state model to clock probes' step traces (clock.json)."""
    main = require("simkv.fitting.clock", "main", "fit clock")
    return call_main(main, [*map(str, probe_dirs), "--model", model, "--out", str(out)])
