"""Validation: the simulator against the real engine, on the same requests.

Split by machine, because the GPU machine has no SimPy:

    measure_validation(scenario, out_dir)      GPU side, simpy-free: the engine serves the
                                               scenario's requests all at t=0 (saturated
                                               throughput), then in real time; both measured
    compare_validation(measured_dir, scenario) CPU side: the simulator (profiled cost model)
                                               serves the same requests; errors, plots, JSON

    error = (simulated - measured) / measured           per metric (ERROR_KEYS)
    load  = offered arrival rate / saturated throughput (requests/s, both on these requests)

A measurement folder holds `meta.json` (scenario, request fingerprint, engine, timings),
`trace.csv` (the canonical window served; never committed, the comparison re-derives it from
the scenario and checks the fingerprint) and `saturated/`, `realtime/` with the engine's
summary.json, requests.csv, steps.csv and ledger.json. steps.csv gains `span_s` (the executor's
CUDA-event span of `execute(plan)`, what the profile measured) and `prep_s` (host input
preparation inside it); `duration_s - span_s` is the engine's host time outside the profile.

Trace workloads on the GPU machine: the shared traces are not there, so `prepare` writes the
scenario's requests (limit applied, time_scale not) as a canonical CSV into a data folder that
travels with the repo, and `load_validation_scenario(path, data_dir)` reads it instead.

    simkv validate prepare SCENARIO... --data .valdata
    simkv validate measure SCENARIO... --data .valdata --out results/validation
        [--pin-cpu N] [--no-trace]
    simkv validate compare SCENARIO --measured results/validation/NAME [--out JSON]
        [--cost-model FIT_JSON] [--gpu-clock auto|fixed] [--calibrate-saturated] [--no-plots]

(`python -m simkv.validate prepare|measure|compare` is the same command, kept for one release.)
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from simkv.errors import InputError
# The halves live in simkv.validation; their names stay importable from here.
from simkv.validation.compare import compare_validation, ledger_num_blocks  # noqa: F401
from simkv.validation.data import (RUNS, load_validation_scenario, prepare_window,  # noqa: F401
                                   requests_fingerprint, window_name)
from simkv.validation.diagnostics import LARGE_BATCH  # noqa: F401
from simkv.validation.measure import LONG_STEP_S, measure_many, measure_validation  # noqa: F401
from simkv.validation.metrics import (BOUNDS, ERROR_KEYS, LOW_LOAD, check_bounds,  # noqa: F401
                                      format_table, relative_error)
from simkv.validation.plots import write_plots  # noqa: F401

__all__ = ["BOUNDS", "ERROR_KEYS", "LARGE_BATCH", "LONG_STEP_S", "LOW_LOAD", "RUNS", "InputError",
           "check_bounds", "compare_validation", "format_table", "ledger_num_blocks",
           "compare_command", "load_validation_scenario", "main", "measure_command",
           "measure_many", "measure_validation", "prepare_command", "prepare_window",
           "relative_error", "requests_fingerprint", "validate_command", "window_name",
           "write_plots"]


def validate_command(scenario_path, device: str = "cuda", out_dir=None, measured_dir=None,
                     *, data_dir=None, strict: bool = False) -> int:
    """`simkv validate SCENARIO --device cuda|cpu [--out DIR] [--measured DIR] [--data DIR]`.

    Without `measured_dir`: measures into `out_dir/<name>/` (default results/validation/<name>),
    then, where simpy is installed, compares; without simpy it says so and stops after
    measuring. With `measured_dir`: compares only (no GPU). The comparison is written to
    `out_dir/<name>.json` when `out_dir` is given, else
    profiles/<gpu>/<model>/validation/<name>.json. Returns the exit code: 0, or 1 when
    `strict` and an error exceeds the issue's bounds.
    """
    if measured_dir is None:
        scn = load_validation_scenario(scenario_path, data_dir)
        measured_dir = Path(out_dir or Path("results") / "validation") / scn.name
        measure_validation(scn, measured_dir, device)
        print(f"measured: {measured_dir}")
        if importlib.util.find_spec("simpy") is None:
            print("simpy is not installed here: measured only. Compare on a machine with simpy:\n"
                  f"  simkv validate {scenario_path} --measured {measured_dir}")
            return 0
    else:
        scn = load_validation_scenario(scenario_path, data_dir)
    out = Path(out_dir) / f"{scn.name}.json" if out_dir is not None else None
    result = compare_validation(measured_dir, scn, out)
    print(format_table([result]))
    return 1 if strict and not result["bounds"]["all_ok"] else 0


def prepare_command(scenarios, data_dir=".valdata") -> int:
    """`simkv validate prepare`: each scenario's trace window as a canonical CSV in `data_dir`."""
    for path in scenarios:
        print(prepare_window(path, data_dir) or f"{path}: synthetic, nothing to write")
    return 0


def measure_command(scenarios, out_dir="results/validation", device: str = "cuda", *,
                    data_dir=None, progress: bool = False, write_trace: bool = True,
                    pin_cpu=None) -> int:
    """`simkv validate measure` (GPU side, no simpy): each scenario into `out_dir/<name>/`."""
    measure_many(scenarios, out_dir, device, data_dir=data_dir, progress=progress,
                 write_trace=write_trace, pin_cpu=pin_cpu)
    return 0


def compare_needs_out(cost_model=None, gpu_clock=None, calibrate: bool = False, set_=None):
    """Why a comparison with these choices needs an explicit --out, or None when it does not."""
    used = [flag for flag, value in (("--cost-model", cost_model), ("--gpu-clock", gpu_clock),
                                     ("--calibrate-saturated", calibrate or None),
                                     ("--set", set_ or None))
            if value is not None]
    if not used:
        return None
    return (f"{' and '.join(used)} need{'s' if len(used) == 1 else ''} --out (the default path "
            "holds the comparison with the scenario's own cost model)")


def compare_command(scenario, measured, out=None, *, cost_model=None, gpu_clock=None,
                    calibrate: bool = False, plots: bool = True, set_=None) -> int:
    """`simkv validate compare` (CPU side): the simulator against a measurement; prints the table.

    `cost_model` (auto | profile | roofline | a fit.json path, taken from the working
    directory) and `gpu_clock` (auto | fixed) replace the scenario's; with either, or with
    `calibrate`, `out` must be given. `set_`: KEY=VALUE scenario overrides (as `simkv run
    --set`), e.g. the request path's delays (docs/semantics.md); they too need `out`.
    """
    problem = compare_needs_out(cost_model, gpu_clock, calibrate, set_) if out is None else None
    if problem:
        raise InputError(problem)
    scn = load_validation_scenario(scenario)
    from simkv.config.keys import parse_set
    overrides = parse_set(list(set_ or ()))
    if cost_model is not None:
        overrides["cost_model"] = (cost_model if cost_model in ("auto", "profile", "roofline")
                                   else str(Path(cost_model).resolve()))
    if gpu_clock is not None:
        overrides["gpu_clock"] = gpu_clock
    if overrides:
        from simkv.config.scenario import with_overrides
        scn = with_overrides(scn, overrides)
    result = compare_validation(measured, scn, out, calibrate=calibrate, plots=plots)
    print(format_table([result]))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m simkv.validate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="write trace windows for a machine without the traces")
    p.add_argument("scenarios", nargs="+")
    p.add_argument("--data", default=".valdata")
    p = sub.add_parser("measure", help="GPU side: measure scenarios into OUT/<name>/")
    p.add_argument("scenarios", nargs="+")
    p.add_argument("--data", default=None)
    p.add_argument("--out", default="results/validation")
    p.add_argument("--device", default="cuda")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--no-trace", action="store_true",
                   help="leave trace.csv (the served rows of a shared trace) out")
    p.add_argument("--pin-cpu", type=int, default=None, metavar="N",
                   help="run pinned to CPU N (as a profile measured with --pin-cpu)")
    p = sub.add_parser("compare", help="CPU side: compare a measurement with the simulator")
    p.add_argument("scenario")
    p.add_argument("--measured", required=True)
    p.add_argument("--out", default=None, help="JSON path (default profiles/<gpu>/<model>/"
                   "validation/<name>.json)")
    p.add_argument("--cost-model", default=None, help="the scenario's cost_model instead "
                   "(auto | profile | roofline | a fit.json, e.g. a profile measured beside "
                   "this measurement)")
    p.add_argument("--gpu-clock", default=None, choices=("auto", "fixed"),
                   help="the scenario's gpu_clock instead (fixed: no clock-state model)")
    p.add_argument("--no-plots", action="store_true", help="write the JSON only")
    p.add_argument("--calibrate-saturated", action="store_true",
                   help="scale the step times so that the simulated all-at-zero run lasts as "
                        "long as the measured saturated run, then compare")
    p.add_argument("--set", dest="set_", action="append", default=[], metavar="KEY=VALUE",
                   help="override a scenario key (repeatable), e.g. the request path's delays")
    return parser


def main(argv=None) -> int:
    """`python -m simkv.validate prepare|measure|compare ...`; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.verb == "compare" and args.out is None:
        problem = compare_needs_out(args.cost_model, args.gpu_clock, args.calibrate_saturated,
                                    args.set_)
        if problem:
            parser.error(problem)
    try:
        if args.verb == "prepare":
            return prepare_command(args.scenarios, args.data)
        if args.verb == "measure":
            return measure_command(args.scenarios, args.out, args.device, data_dir=args.data,
                                   progress=args.progress, write_trace=not args.no_trace,
                                   pin_cpu=args.pin_cpu)
        return compare_command(args.scenario, args.measured, args.out,
                               cost_model=args.cost_model, gpu_clock=args.gpu_clock,
                               calibrate=args.calibrate_saturated, plots=not args.no_plots,
                               set_=args.set_)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
