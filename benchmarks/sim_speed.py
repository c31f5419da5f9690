"""Simulator speed: simulated seconds per wall second on the whole shared Azure conv trace.

    python benchmarks/sim_speed.py [--runs 3] [--profile] [--tail-ab N] [--clock-ab N]
        [--against DIR --ab N] [--json OUT.json]

Each run is a whole `simkv run` process (start-up, trace loading, simulation and result writing
included), timed from outside; the ratio is sim_duration_s / wall seconds. `--profile` then runs
the simulation once in-process under cProfile and reports where the time goes, by component.
`--against DIR --ab N` times the same whole `simkv run` process in this checkout and in another
one (DIR, e.g. a worktree of an earlier commit), alternated N times, in CPU seconds of the child
processes (user + system, from os.wait4): the new checkout's CPU time over the other's, per pair
and as the median. `--tail-ab N` times, in one process and alternated N times, the first 6,000 requests at twice
their rate (32 GiB) with the profile's fit as it is and with its decode tail taken the earlier
way (the longest program against an even share, `decode_tail_in_order` off): the cost of the
in-order tail as a ratio. `--clock-ab N` likewise times the same requests with the GPU
clock-state model (the default) and with the clock fixed (`gpu_clock: fixed`).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
SCENARIO = f"""\
name: azure-conv-speed
model: llama-3.1-8b
gpu: h200
cost_model: auto
cache: {{block_size: 16}}
workload: {{trace: {TRACE}}}
"""
COMPONENTS = [("scheduler", "simkv/engine/scheduler.py"), ("kv manager", "simkv/engine/kv/"),
              ("metrics", "simkv/engine/metrics.py"), ("cost model", "simkv/costmodel/"),
              ("sim loop", "simkv/sim/"), ("sim loop", "simkv/engine/loop.py"),
              ("traces", "simkv/workload/"),
              ("simpy", "simpy/"), ("pandas/numpy", "pandas/"), ("pandas/numpy", "numpy/")]


def whole_process_runs(scenario: Path, runs: int) -> list:
    out = []
    for i in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "simkv.cli", "run", str(scenario),
                                   "--out", tmp, "--json"], capture_output=True, text=True)
            wall = time.perf_counter() - start
            if proc.returncode:
                sys.exit(f"simkv run failed: {proc.stderr.strip()}")
            summary = json.loads(Path(tmp, "summary.json").read_text())
        out.append({"wall_s": wall, "sim_duration_s": summary["sim_duration_s"],
                    "num_steps": summary["num_steps"],
                    "speedup": summary["sim_duration_s"] / wall})
        print(f"run {i + 1}: {wall:.2f} s wall, {summary['sim_duration_s']:.0f} sim s, "
              f"{summary['num_steps']} steps, {out[-1]['speedup']:.0f}x real time")
    return out


def _cpu_run(scenario: Path, checkout: Path) -> tuple:
    """(CPU seconds, wall seconds, sim_duration_s) of one `simkv run` process of `checkout`."""
    import os
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(checkout))
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "simkv.cli", "run", str(scenario),
                                 "--out", tmp, "--json"], cwd=checkout, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if status:
            sys.exit(f"simkv run in {checkout} failed: {proc.stderr.read().decode().strip()}")
        summary = json.loads(Path(tmp, "summary.json").read_text())
    return usage.ru_utime + usage.ru_stime, wall, summary["sim_duration_s"]


def checkout_ab(scenario: Path, other: Path, repeats: int) -> dict:
    """CPU seconds of the whole run here over the same run in `other`, alternated."""
    import statistics
    runs = {"this": [], "other": []}
    for i in range(repeats):
        for name, checkout in ((("other", other), ("this", ROOT)) if i % 2
                               else (("this", ROOT), ("other", other))):
            cpu, wall, sim_s = _cpu_run(scenario, checkout)
            runs[name].append({"cpu_s": cpu, "wall_s": wall, "sim_duration_s": sim_s})
            print(f"pair {i + 1} {name:5s}: {cpu:6.2f} CPU s, {wall:6.2f} s wall, "
                  f"{sim_s:.0f} sim s", flush=True)
    ratios = [a["cpu_s"] / b["cpu_s"] for a, b in zip(runs["this"], runs["other"])]
    print(f"\nCPU seconds, this checkout over {other}: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}")
    return {"runs": runs, "ratios": ratios, "median_ratio": statistics.median(ratios),
            "other": str(other)}


def profile_components(scenario: Path) -> dict:
    import simkv
    from simkv.sim.engine import simulate
    scn = simkv.load_scenario(scenario)
    prof = cProfile.Profile()
    prof.enable()
    simulate(scn)
    prof.disable()
    stats = pstats.Stats(prof)
    totals: dict = {}
    for (filename, _, func), (_, _, tottime, _, _) in stats.stats.items():
        name = next((label for label, part in COMPONENTS if part in filename.replace("\\", "/")),
                    "builtins/other")
        totals[name] = totals.get(name, 0.0) + tottime
    grand = sum(totals.values())
    print("\nwhere the time goes (cProfile self time; profiling inflates Python-heavy parts):")
    for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:16s} {seconds:7.2f} s  {100 * seconds / grand:5.1f}%")
    print("\ntop functions by self time:")
    stats.sort_stats("tottime").print_stats(12)
    return {k: round(v / grand, 4) for k, v in totals.items()}


def _ab_scenario(scenario: Path, **top):
    import simkv
    return simkv.load_scenario(scenario, {"workload.limit": 6000, "workload.time_scale": 0.5,
                                          "cache.memory_budget_gib": 32,
                                          "scheduler.max_model_len": 16384, **top})


def _ab(label: str, scn, models: dict, repeats: int) -> dict:
    """Wall seconds of the same simulation with each of two cost models, alternated `repeats`
    times in this process; the median ratio of the first over the second."""
    import statistics
    from simkv.sim.engine import simulate
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in reversed(list(models.items())):
            start = time.perf_counter()
            simulate(scn, cost_model=model)
            times[name].append(time.perf_counter() - start)
    first, second = models
    ratio = statistics.median(a / b for a, b in zip(times[first], times[second]))
    shown = ", ".join(f"{name} {', '.join(f'{t:.2f}' for t in v)} s" for name, v in times.items())
    print(f"\n{label} A/B ({repeats}x alternated): {shown}; median ratio {ratio:.2f}")
    return {"seconds": times, "median_ratio": ratio}


def tail_ab(scenario: Path, repeats: int) -> dict:
    """The decode tail in launch order against the even-share tail (the earlier way)."""
    import dataclasses
    from simkv.costmodel import load_cost_model
    scn = _ab_scenario(scenario, gpu_clock="fixed")
    on = load_cost_model(scn)
    off = load_cost_model(scn)
    off.layout = dataclasses.replace(off.layout, decode_tail_in_order=False)
    return _ab("decode tail", scn, {"in_order": on, "even_share": off}, repeats)


def clock_ab(scenario: Path, repeats: int) -> dict:
    """The profiled model under the GPU's clock state against the clock fixed."""
    from simkv.costmodel import load_cost_model
    scn = _ab_scenario(scenario)
    fixed = load_cost_model(_ab_scenario(scenario, gpu_clock="fixed"))
    return _ab("clock state", scn, {"clock": load_cost_model(scn), "fixed": fixed}, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--tail-ab", type=int, default=0, metavar="N",
                    help="also time the decode tail in order against the even-share tail")
    ap.add_argument("--clock-ab", type=int, default=0, metavar="N",
                    help="also time the GPU clock-state model against the clock fixed")
    ap.add_argument("--against", type=Path, metavar="DIR",
                    help="another checkout to time against (with --ab)")
    ap.add_argument("--ab", type=int, default=3, metavar="N",
                    help="pairs of runs against --against (default 3)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if not TRACE.exists():
        sys.exit(f"skipped: the shared Azure trace is not at {TRACE}")
    with tempfile.TemporaryDirectory() as tmp:
        scenario = Path(tmp, "azure.yaml")
        scenario.write_text(SCENARIO)
        if args.against is not None:
            ab = checkout_ab(scenario, args.against.resolve(), args.ab)
            if args.json:
                args.json.write_text(json.dumps({"checkout_ab": ab, "command": " ".join(sys.argv),
                                                 "python": platform.python_version(),
                                                 "machine": platform.machine()}, indent=2) + "\n")
            return
        runs = whole_process_runs(scenario, args.runs)
        best = max(runs, key=lambda r: r["speedup"])
        median = sorted(r["speedup"] for r in runs)[len(runs) // 2]
        print(f"\nmedian {median:.0f}x real time, best {best['speedup']:.0f}x "
              f"({best['num_steps'] / best['wall_s']:.0f} steps/s) on {platform.processor() or platform.machine()}")
        shares = profile_components(scenario) if args.profile else None
        ab = tail_ab(scenario, args.tail_ab) if args.tail_ab else None
        clock = clock_ab(scenario, args.clock_ab) if args.clock_ab else None
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "median_speedup": median,
                                         "profile_shares": shares, "tail_ab": ab,
                                         "clock_ab": clock,
                                         "python": platform.python_version(),
                                         "machine": platform.machine(),
                                         "command": " ".join(sys.argv)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
