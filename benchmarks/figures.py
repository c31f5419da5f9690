"""Re-simulate every committed simulated figure and compare it with a saved set.

    python benchmarks/figures.py --out figures.json                  # simulate, write the set
    python benchmarks/figures.py --out new.json --compare old.json   # and compare with another

The set: the quickstart run; the what-if studies of docs/whatif.md (the Azure block size x
budget sweep, the block-size study, paged vs contiguous, swap vs recompute, the step-time scale
sweep, the two capacity searches); the simulated side of every committed validation result
(each measured run of `profiles/h200/llama-3.1-8b` against the profile its result used, in real
time and with every request at 0; lease B also with the clock fixed and calibrated by its
saturated run). Every figure is a summary's scalars (wall time left out). `--compare` prints the
largest relative difference per figure and exits 1 when one exceeds `--rtol` (default 1e-9).

A refactoring that must not change what the simulator predicts runs this before and after
(the first on a checkout of the earlier commit). `--only PREFIX` runs the figures whose name
starts with it; `--quick` leaves out the full-trace sweep (the slowest part, about 2 minutes on
2 cores). Needs the shared traces (../shared/traces); figures whose trace is absent are skipped
and listed.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PROFILE = ROOT / "profiles/h200/llama-3.1-8b"
VALIDATION = ROOT / "scenarios/validation"
DROP = ("wall_time_s",)


def _flat(summary: dict) -> dict:
    out = {}
    for key, value in summary.items():
        if key in DROP:
            continue
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"{key}.{sub}"] = float(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, str):
            out[key] = value
    return out


def _frame(scn):
    try:
        from simkv.workload.frames import load_requests_frame
    except ImportError:
        from simkv.sim.setup import load_requests_frame
    return load_requests_frame(scn)


def _num_blocks(scn) -> int:
    try:
        from simkv.sizing import size_pool
    except ImportError:
        from simkv.core.sizing import size_pool
    return size_pool(scn.model, scn.gpu, scn.cache, scn.scheduler).num_blocks


def _validation_runs() -> list:
    """(figure name, scenario, measured dir, cost model path or None, extra overrides)."""
    runs = []
    for yaml_path in sorted(VALIDATION.glob("*.yaml")):
        name = yaml_path.stem
        measured = PROFILE / "validation" / name
        if measured.is_dir():
            runs.append((f"val/B/{name}", yaml_path, measured, None, {}))
            runs.append((f"val/B-fixed/{name}", yaml_path, measured, None,
                         {"gpu_clock": "fixed"}))
            calibrated = PROFILE / "validation" / "calibrated" / f"{name}.json"
            if calibrated.is_file():
                scale = json.loads(calibrated.read_text())["calibration"]["step_time_scale"]
                runs.append((f"val/B-cal/{name}", yaml_path, measured, None,
                             {"step_time_scale": scale}))
        for lease in sorted(PROFILE.glob("repeat*")):
            profile = next(iter(sorted(lease.glob("profile*/fit.json"))), None)
            for run in sorted(lease.glob("run*")):
                if (run / name).is_dir():
                    runs.append((f"val/{lease.name}/{run.name}/{name}", yaml_path, run / name,
                                 profile, {}))
    return runs


def validation_figure(args) -> dict:
    """The simulated side of one validation comparison: real-time and all-at-zero summaries."""
    import simkv
    _, yaml_path, measured, profile, sets = args
    overrides = dict(sets)
    if profile is not None:
        overrides["cost_model"] = str(profile)
    scn = simkv.load_scenario(yaml_path, overrides=overrides)
    served = json.loads((Path(measured) / "realtime/summary.json").read_text()).get("num_blocks")
    if served and served != _num_blocks(scn) and scn.cache.num_gpu_blocks_override is None:
        scn = simkv.load_scenario(yaml_path, overrides={
            **overrides, "cache.num_gpu_blocks_override": int(served)})
    frame = _frame(scn)
    at_zero = frame.copy()
    at_zero["arrival_s"] = 0.0
    return {"realtime": _flat(simkv.simulate(scn, trace_df=frame).summary),
            "saturated": _flat(simkv.simulate(scn, trace_df=at_zero).summary)}


def sweep_figure(args) -> dict:
    """One point of a what-if sweep."""
    import simkv
    _, path, overrides = args
    return _flat(simkv.simulate(simkv.load_scenario(ROOT / path, overrides=overrides)).summary)


def capacity_figure(args) -> dict:
    import simkv
    from simkv.whatif.capacity import find_capacity
    _, path, overrides, replicates = args
    res = find_capacity(simkv.load_scenario(ROOT / path, overrides=overrides),
                        replicates=replicates, workers=1)
    return {"max_rate_rps": res.max_rate_rps, "rate_scale": res.rate_scale,
            "ci": res.ci or {}, "summary": _flat(res.summary),
            "probes": {f"{i}": rate for i, (rate, _met) in enumerate(res.probes)}}


def _grid(**axes) -> list:
    points = [{}]
    for key, values in axes.items():
        points = [{**p, key.replace("__", "."): v} for p in points for v in values]
    return points


def whatif_jobs(quick: bool) -> list:
    jobs = [("whatif/quickstart", "scenarios/quickstart.yaml", {})]
    for scale in (0.9, 1.0, 1.1):
        jobs.append((f"whatif/quickstart-scale-{scale}", "scenarios/quickstart.yaml",
                     {"step_time_scale": scale}))
    for p in _grid(cache__block_size=(8, 16, 32, 64, 128)):
        jobs.append((f"whatif/block-size-study/{p}", "scenarios/block-size-study.yaml", p))
        jobs.append((f"whatif/block-size-study-fixed/{p}", "scenarios/block-size-study.yaml",
                     {**p, "gpu_clock": "fixed"}))
    for p in _grid(cache__allocator=("paged", "contiguous"),
                   cache__memory_budget_gib=(26, 32, 47)):
        jobs.append((f"whatif/paged-vs-contiguous/{p}", "scenarios/paged-vs-contiguous.yaml", p))
    for p in _grid(cache__preemption_mode=("recompute", "swap"),
                   cache__memory_budget_gib=(22, 24, 26)):
        jobs.append((f"whatif/swap-vs-recompute/{p}", "scenarios/swap-vs-recompute.yaml", p))
    if not quick:
        for p in _grid(cache__block_size=(8, 16, 32, 64, 128),
                       cache__memory_budget_gib=(22, 26, 32, 47)):
            jobs.append((f"whatif/azure-sweep/{p}", "scenarios/azure-conv.yaml",
                         {**p, "workload.time_scale": 0.5}))
    return jobs


def capacity_jobs() -> list:
    return [("capacity/quickstart-x5", "scenarios/quickstart.yaml", {}, 5),
            ("capacity/azure-4000-x3", "scenarios/azure-conv.yaml", {"workload.limit": 4000}, 3)]


def _run(job):
    kind, args = job
    t0 = time.process_time()
    try:
        value = {"validation": validation_figure, "sweep": sweep_figure,
                 "capacity": capacity_figure}[kind](args)
    except FileNotFoundError as e:
        return args[0], {"skipped": str(e)}, 0.0
    except Exception as e:   # an InputError for an absent trace, say: listed, not fatal
        if "does not exist" in str(e) or "not found" in str(e):
            return args[0], {"skipped": str(e)}, 0.0
        raise
    return args[0], value, time.process_time() - t0


def _leaves(value, prefix=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix, value


def compare(new: dict, old: dict, rtol: float) -> int:
    """Print each new figure's largest relative difference from the old one (figures left out of
    the new set, by --only or --quick, are not compared); the number beyond rtol."""
    bad = 0
    for name in sorted(new):
        if name not in old:
            print(f"     new figure  {name}")
            bad += 1
            continue
        a, b = dict(_leaves(new[name])), dict(_leaves(old[name]))
        worst, where = 0.0, ""
        for key in set(a) | set(b):
            x, y = a.get(key), b.get(key)
            if isinstance(x, float) and isinstance(y, float):
                if math.isnan(x) and math.isnan(y):
                    continue
                d = abs(x - y) / max(abs(y), 1e-300) if x != y else 0.0
            else:
                d = 0.0 if x == y else math.inf
            if d > worst:
                worst, where = d, key
        flag = "DIFF" if worst > rtol else "ok"
        if worst > rtol:
            bad += 1
        print(f"{flag:>4} {worst:10.3g}  {name}  {where}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare")
    ap.add_argument("--rtol", type=float, default=1e-9)
    ap.add_argument("--only", default="")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    a = ap.parse_args(argv)
    jobs = [("validation", r) for r in _validation_runs()]
    jobs += [("sweep", j) for j in whatif_jobs(a.quick)]
    jobs += [("capacity", j) for j in capacity_jobs()]
    jobs = [j for j in jobs if j[1][0].startswith(a.only)]
    figures, cpu = {}, 0.0
    with ProcessPoolExecutor(a.workers) as pool:
        for i, (name, value, seconds) in enumerate(pool.map(_run, jobs), 1):
            figures[name] = value
            cpu += seconds
            print(f"[{i}/{len(jobs)}] {name} ({seconds:.1f} s)", file=sys.stderr, flush=True)
    Path(a.out).write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    skipped = [n for n, v in figures.items() if isinstance(v, dict) and "skipped" in v]
    print(f"{len(figures)} figures ({len(skipped)} skipped), {cpu:.0f} CPU s -> {a.out}")
    if a.compare:
        bad = compare(figures, json.loads(Path(a.compare).read_text()), a.rtol)
        print(f"{bad} figures differ beyond rtol {a.rtol:g}")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
