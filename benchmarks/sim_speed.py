"""Simulator speed: simulated seconds per CPU second, whole processes and the simulation alone.

    python benchmarks/sim_speed.py [--scenario azure|mooncake-memory|running-1024] [--runs 3]
        [--against DIR --ab N] [--in-process N] [--per-step] [--profile] [--tail-ab N]
        [--clock-ab N] [--parts] [--json OUT.json]

Scenarios: `azure` (default), the whole shared Azure conv trace on the profiled H200 model with
its default effects, max_num_seqs 256 and 8,192 batched tokens; `mooncake-memory` and
`running-1024` (benchmarks/scenarios/): the shared Mooncake trace at its recorded rate on a 30
GiB budget (memory-bound, preempting), and 1,024 sequences running at once.

Each run of `--runs` is a whole `simkv run` process (start-up, trace loading, simulation and
result writing included), timed from outside; the ratio is sim_duration_s / wall seconds.
`--against DIR --ab N` times the same whole `simkv run` process in this checkout and in another
one (DIR, e.g. a git worktree of an earlier commit: `git worktree add /tmp/base b20c84b`),
alternated N times, in CPU seconds of the child processes (user + system, from os.wait4): each
side's min/median/max, the new checkout's CPU time over the other's per pair, and the median
(a speed-up is its inverse). `--in-process N` times, in this process and alternated N times,
the simulation alone (Simulation.run, CPU seconds) step by step (`exact`) and with decode runs,
the result writer's CPU seconds, and checks that both give the same summary.json (but wall
time), requests.csv and steps.csv, byte for byte. `--per-step` gives the simulation's CPU
microseconds per step at 1k, 5k and 19k requests of the Azure conv trace (what must not grow
with the run), then the first 1,000 requests tiled 1, 5 and 19 times (the same work per step
whatever the length) and 1,000-request windows at three offsets (what the trace's parts ask).
`--profile` runs the simulation once in-process under cProfile and reports where the time goes,
by component; `--parts` times the simulation's main parts (PARTS) around each call, without
cProfile's inflation of small functions. `--tail-ab N` times, in one process and alternated N
times, the first 6,000 requests at twice their rate (32 GiB) with the profile's fit as it is and with its
decode tail taken the earlier way (the longest program against an even share,
`decode_tail_in_order` off): the cost of the in-order tail as a ratio. `--clock-ab N` likewise
times the same requests with the GPU clock-state model (the default) and with the clock fixed
(`gpu_clock: fixed`).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH_SCENARIOS = {"mooncake-memory": ROOT / "benchmarks" / "scenarios" / "mooncake-memory.yaml",
                   "running-1024": ROOT / "benchmarks" / "scenarios" / "running-1024.yaml"}
MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake-fast25" / "synthetic_trace.jsonl"
TRACE = ROOT.parent / "shared" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
SCENARIO = f"""\
name: azure-conv-speed
model: llama-3.1-8b
gpu: h200
cost_model: auto
cache: {{block_size: 16}}
scheduler: {{max_num_seqs: 256, max_num_batched_tokens: 8192}}
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
                                   *_same_work(ROOT), "--out", tmp, "--json"],
                                  capture_output=True, text=True)
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


# Every run here takes semantics vllm-0.18's rules, those of the commits before the key existed,
# so that both sides of a comparison do the same work.
SAME_WORK = {"semantics": "vllm-0.18"}


def _same_work(checkout: Path) -> list:
    """The `--set` arguments that make `checkout` follow semantics vllm-0.18 (none before the
    key existed: those commits had only those rules)."""
    if (checkout / "simkv" / "semantics.py").is_file():
        return ["--set", "semantics=vllm-0.18"]
    return []


def _cpu_run(scenario: Path, checkout: Path) -> tuple:
    """(CPU seconds, wall seconds, sim_duration_s) of one `simkv run` process of `checkout`."""
    import os
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(checkout))
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "simkv.cli", "run", str(scenario),
                                 *_same_work(checkout), "--out", tmp, "--json"], cwd=checkout,
                                env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if status:
            sys.exit(f"simkv run in {checkout} failed: {proc.stderr.read().decode().strip()}")
        summary = json.loads(Path(tmp, "summary.json").read_text())
    return usage.ru_utime + usage.ru_stime, wall, summary["sim_duration_s"]


def _spread(values: list) -> str:
    import statistics
    return (f"min {min(values):.2f}, median {statistics.median(values):.2f}, "
            f"max {max(values):.2f}")


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
                  f"{sim_s:.0f} sim s ({sim_s / cpu:.0f}x real time per CPU s)", flush=True)
    ratios = [a["cpu_s"] / b["cpu_s"] for a, b in zip(runs["this"], runs["other"])]
    for name in runs:
        print(f"{name:5s} CPU s: {_spread([r['cpu_s'] for r in runs[name]])}")
    median = statistics.median(ratios)
    print(f"\nCPU seconds, this checkout over {other}: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}; median {median:.3f} "
          f"({1 / median:.2f}x faster)")
    return {"runs": runs, "ratios": ratios, "median_ratio": median, "speedup": 1 / median,
            "other": str(other)}


def _outputs(result) -> tuple:
    from simkv.engine.results import csv_text
    summary = dict(result.summary)
    summary.pop("wall_time_s")
    return json.dumps(summary, indent=2), csv_text(result.requests), csv_text(result.steps)


def _loaded(scenario: Path) -> tuple:
    """(scenario, its requests' frame), loaded once for the simulations an option times."""
    import simkv
    from simkv.sim.engine import Simulation
    scn = simkv.load_scenario(scenario, SAME_WORK)
    return scn, Simulation(scn).frame


def in_process(scenario: Path, repeats: int) -> dict:
    """The simulation alone (CPU s), step by step and with decode runs, alternated; the
    writer's CPU seconds; and whether both give the same bytes."""
    import statistics
    from simkv.sim.engine import Simulation
    scn, frame = _loaded(scenario)
    times = {"exact": [], "runs": [], "write": []}
    identical = True
    sim_s = 0.0
    for i in range(repeats):
        outs = {}
        for exact in ((True, False) if i % 2 == 0 else (False, True)):
            sim = Simulation(scn, frame, exact=exact)
            start = time.process_time()
            result = sim.run()
            times["exact" if exact else "runs"].append(time.process_time() - start)
            outs[exact] = _outputs(result)
            sim_s = result.summary["sim_duration_s"]
            if not exact:
                with tempfile.TemporaryDirectory() as tmp:
                    start = time.process_time()
                    result.write(tmp)
                    times["write"].append(time.process_time() - start)
        identical = identical and outs[True] == outs[False]
        print(f"round {i + 1}: step by step {times['exact'][-1]:.2f} CPU s, decode runs "
              f"{times['runs'][-1]:.2f} CPU s, writing {times['write'][-1]:.2f} CPU s; "
              f"same bytes: {outs[True] == outs[False]}", flush=True)
    ratio = statistics.median(a / b for a, b in zip(times["exact"], times["runs"]))
    runs_s = statistics.median(times["runs"])
    print(f"\nsimulation alone: step by step {_spread(times['exact'])} CPU s; decode runs "
          f"{_spread(times['runs'])} CPU s ({sim_s / runs_s:.0f}x real time); "
          f"{ratio:.2f}x; writing {_spread(times['write'])} CPU s; identical: {identical}")
    return {"cpu_s": times, "speedup_over_exact": ratio, "identical": identical,
            "sim_duration_s": sim_s}


def per_step(repeats: int = 3) -> dict:
    """CPU microseconds per step of the simulation at 1k, 5k and 19k Azure conv requests; then
    the same counts as the first 1,000 requests tiled 1, 5 and 19 times (each copy a minute
    after the one before ends, under new request ids), which separates what the run's length
    costs per step from what the later parts of the trace ask (their requests arrive closer
    together: fewer decode-only steps between events); and a 1,000-request window at three
    offsets of the trace, which shows that second effect alone."""
    import statistics
    import pandas as pd
    import simkv
    from simkv.sim.engine import Simulation

    def timed(scn, frame=None) -> tuple:
        us = []
        for _ in range(repeats):
            sim = Simulation(scn, frame)
            start = time.process_time()
            steps = sim.run().summary["num_steps"]
            us.append(1e6 * (time.process_time() - start) / steps)
        return statistics.median(us), steps, us

    def show(label: str, us: float, steps: int, each: list) -> None:
        print(f"{label}: {us:.2f} CPU us per step ({steps} steps; "
              f"{', '.join(f'{u:.2f}' for u in each)})", flush=True)

    out = {"prefix": {}, "tiled": {}, "windows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "azure.yaml")
        path.write_text(SCENARIO)
        for limit in (1000, 5000, 19366):
            scn = simkv.load_scenario(path, {"workload.limit": limit, **SAME_WORK})
            us, steps, each = timed(scn)
            out["prefix"][limit] = {"us_per_step": us, "steps": steps}
            show(f"{limit:6d} requests", us, steps, each)
        scn = simkv.load_scenario(path, {"workload.limit": 1000, **SAME_WORK})
        first = Simulation(scn).frame
        period = float(first["arrival_s"].max()) + 60.0
        for copies in (1, 5, 19):
            frame = pd.concat([first.assign(arrival_s=first["arrival_s"] + k * period,
                                            request_id=first["request_id"] + k * len(first))
                               for k in range(copies)], ignore_index=True)
            us, steps, each = timed(scn, frame)
            out["tiled"][copies] = {"us_per_step": us, "steps": steps}
            show(f"first 1,000 x {copies:2d}", us, steps, each)
        for offset in (0, 9000, 18000):
            scn = simkv.load_scenario(path, {"workload.limit": 1000, "workload.offset": offset,
                                             **SAME_WORK})
            us, steps, each = timed(scn)
            out["windows"][offset] = {"us_per_step": us, "steps": steps}
            show(f"requests {offset}-{offset + 999}", us, steps, each)
    for part in ("prefix", "tiled"):
        values = [v["us_per_step"] for v in out[part].values()]
        out[part + "_spread"] = max(values) / min(values) - 1
    print(f"per-step spread: the trace's first 1k/5k/19k {out['prefix_spread']:+.1%}, "
          f"the first 1,000 tiled x1/x5/x19 {out['tiled_spread']:+.1%}")
    return out


def profile_components(scenario: Path) -> dict:
    import simkv
    from simkv.sim.engine import simulate
    scn = simkv.load_scenario(scenario, SAME_WORK)
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


PARTS = [("simkv.costmodel.clock", "ClockedCostModel.decode_run_seconds",
          "a decode run's step times (the clock state stepped through them)"),
         ("simkv.costmodel.clock", "ClockedCostModel.term_values", "a single step's terms"),
         ("simkv.engine.decode_run", "DecodeRun.commit",
          "applying a decode run (its KV blocks, rows, tokens; finish_step of its last step)"),
         ("simkv.engine.scheduler", "Scheduler.schedule", "planning a step"),
         ("simkv.engine.scheduler", "Scheduler._schedule_running", "  of it: the running pass"),
         ("simkv.engine.scheduler", "Scheduler._admit_waiting",
          "  of it: admitting waiting requests (prefix lookups, their prompts' blocks)"),
         ("simkv.engine.scheduler", "Scheduler.finish_step",
          "finishing a step (also inside commit)"),
         ("simkv.engine.metrics", "MetricsRecorder.observe", "observing a single step's KV")]


def parts(scenario: Path) -> dict:
    """CPU seconds of the simulation inside each of PARTS, timed around every call with
    time.process_time (cProfile's per-call cost inflates small functions instead), and the
    whole simulation, timed once without the timers and once with them: the difference is
    the timers' own cost (about 1.5 us a call on the Azure trace, the 2-core VM), which a part holds for its
    own calls and those of the parts inside it."""
    import importlib
    from simkv.sim.engine import Simulation
    scn, frame = _loaded(scenario)
    sim = Simulation(scn, frame)
    start = time.process_time()
    sim.run()
    plain = time.process_time() - start
    spent, saved = {}, []
    for module, name, _ in PARTS:
        cls_name, attr = name.split(".")
        cls = getattr(importlib.import_module(module), cls_name)
        original = getattr(cls, attr)
        saved.append((cls, attr, original))
        spent[name] = [0.0, 0]

        def timed(*args, _f=original, _acc=spent[name], **kwargs):
            t = time.process_time()
            try:
                return _f(*args, **kwargs)
            finally:
                _acc[0] += time.process_time() - t
                _acc[1] += 1
        setattr(cls, attr, timed)
    try:
        sim = Simulation(scn, frame)
        start = time.process_time()
        sim.run()
        timed_total = time.process_time() - start
    finally:
        for cls, attr, original in saved:
            setattr(cls, attr, original)
    print(f"\nthe simulation alone: {plain:.2f} CPU s ({timed_total:.2f} with the timers); "
          "inside (a part may hold another):")
    for _, name, what in PARTS:
        seconds, calls = spent[name]
        print(f"  {name:38s} {seconds:6.2f} CPU s {calls:8d} calls "
              f"{1e6 * seconds / max(calls, 1):8.1f} us each  {what}")
    return {"simulation_cpu_s": plain, "with_timers_cpu_s": timed_total,
            "parts": {name: {"cpu_s": spent[name][0], "calls": spent[name][1]}
                      for _, name, _ in PARTS}}


def _ab_scenario(scenario: Path, **top):
    import simkv
    return simkv.load_scenario(scenario, {**SAME_WORK, "workload.limit": 6000,
                                          "workload.time_scale": 0.5,
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


def _commit(checkout: Path) -> str:
    """The checkout's commit (with '+changes' when its tracked files differ), or ''."""
    def git(*args):
        return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True,
                              text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    return head + ("+changes" if head and git("status", "--porcelain", "-uno") else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="azure", choices=["azure", *BENCH_SCENARIOS])
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
    ap.add_argument("--in-process", type=int, default=0, metavar="N",
                    help="time the simulation alone, step by step and with decode runs, N times")
    ap.add_argument("--per-step", action="store_true",
                    help="CPU microseconds per step at 1k, 5k and 19k Azure conv requests, the first "
                         "1,000 tiled x1/x5/x19, and three 1,000-request windows")
    ap.add_argument("--parts", action="store_true",
                    help="CPU seconds of the simulation inside its main parts (timed per call)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    needs = TRACE if args.scenario == "azure" or args.per_step else MOONCAKE \
        if args.scenario == "mooncake-memory" else None
    if needs is not None and not needs.exists():
        sys.exit(f"skipped: the shared trace is not at {needs}")
    meta = {"command": " ".join(sys.argv), "scenario": args.scenario,
            "date": time.strftime("%Y-%m-%d"), "commit": _commit(ROOT),
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count()}
    if args.against is not None:
        meta["other_commit"] = _commit(args.against)
    with tempfile.TemporaryDirectory() as tmp:
        scenario = BENCH_SCENARIOS.get(args.scenario) or Path(tmp, "azure.yaml")
        if args.scenario == "azure":
            scenario.write_text(SCENARIO)
        if args.against is not None or args.in_process or args.per_step or args.parts:
            figures = dict(meta)
            if args.against is not None:
                figures["checkout_ab"] = checkout_ab(scenario, args.against.resolve(), args.ab)
            if args.in_process:
                figures["in_process"] = in_process(scenario, args.in_process)
            if args.per_step:
                figures["per_step"] = per_step()
            if args.parts:
                figures["parts"] = parts(scenario)
            if args.json:
                args.json.write_text(json.dumps(figures, indent=2) + "\n")
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
                                         "clock_ab": clock, **meta}, indent=2) + "\n")


if __name__ == "__main__":
    main()
