"""The profiler's command line (`python -m simkv.gpu.profiler`, see the package's docstring)."""
from __future__ import annotations

import argparse
import json
import sys

from simkv.errors import InputError
from simkv.gpu.profiler.parts import OPTIONAL_PARTS, PARTS
from simkv.gpu.profiler.run import run_profile
from simkv.gpu.profiler.tensor_parallel import TP_PARTS

DESCRIPTION = "The profiling pass: the real executor over a designed grid of step compositions."


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simkv.gpu.profiler", description=DESCRIPTION)
    p.add_argument("--model", required=True)
    p.add_argument("--block-sizes", default="8,16,32,64,128")
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--time-budget-s", type=float, default=None)
    p.add_argument("--reps", type=int, default=None,
                   help="timed rounds over the design (default 5; at most 3 for steps over 50 ms)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help="comma-separated: " + ", ".join(PARTS + OPTIONAL_PARTS))
    p.add_argument("--fit", action="store_true", help="run `simkv fit` on the result")
    p.add_argument("--pin-cpu", type=int, default=None, metavar="N",
                   help="run pinned to CPU N (run the validation engine pinned as well)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="profile a replica of N ranks, one process each (parts: steps, "
                        "transfers, allreduce; folder <model>-tp<N>)")
    return p


def main(argv=None, fit_profile=None) -> int:
    """Parse the flags, profile, and with --fit print the fit's hold-out error and form.

    `fit_profile(profile_dir) -> fit dict` does the fitting: simkv.fitting sits above simkv.gpu,
    so the command (`__main__.py`) hands it in; without it --fit is refused before profiling."""
    cli = parser()
    args = cli.parse_args(argv)
    sizes = tuple(int(b) for b in args.block_sizes.split(","))
    tp = args.tensor_parallel_size
    if tp > 1 and args.parts == ",".join(PARTS):      # the default set of a TP profile
        args.parts = ",".join(TP_PARTS)
    parts = tuple(p for p in args.parts.split(",") if p)
    known = TP_PARTS if tp > 1 else PARTS + OPTIONAL_PARTS
    if tp < 1:
        cli.error(f"--tensor-parallel-size must be at least 1, got {tp}")
    if tp > 1 and args.pin_cpu is not None:
        cli.error("--pin-cpu pins one process: not with --tensor-parallel-size")
    unknown = [p for p in parts if p not in known]
    if args.reps is not None and args.reps < 1:
        cli.error(f"--reps must be at least 1, got {args.reps}")
    if unknown:
        cli.error(f"unknown part(s) {', '.join(unknown)} "
                  f"(choose from {', '.join(known)})")
    if "rested" in parts and "steps" not in parts:
        cli.error("the rested part times the step grid again: it needs the steps part")
    if "serving" in parts and "engine" not in parts:
        cli.error("the serving part sets its arrival rate from the engine pass: it needs the "
                  "engine part")
    if args.fit and fit_profile is None:
        cli.error("--fit needs the fitting: run `python -m simkv.gpu.profiler`, or `simkv fit "
                  "DIR` afterwards")
    try:
        if tp > 1:
            from simkv.gpu.profiler.tensor_parallel import run_tp_profile
            out = run_tp_profile(args.model, tp, sizes, args.out, args.quick, args.device,
                                 reps=args.reps, time_budget_s=args.time_budget_s, parts=parts)
        else:
            out = run_profile(args.model, sizes, args.out, args.quick, args.device,
                              reps=args.reps, time_budget_s=args.time_budget_s, parts=parts,
                              pin_cpu=args.pin_cpu)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.fit and "steps" in parts:
        fit = fit_profile(out)
        print(json.dumps({"holdout_error": {k: fit["holdout_error"][k]
                                            for k in ("median", "p95", "max", "count")},
                          "form": fit["form"]}))
    return 0
