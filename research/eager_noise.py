"""Why do a small model's eager steps vary? A probe of one executor's eager steps.

    python research/eager_noise.py --model llama-3.2-1b --out DIR     # GPU (no simpy), ~1 min

On a 1B, steps with prefill chunks above the largest mixed CUDA graph ran eagerly, and on the
fourth profile of 2026-11-29 (graphs up to 1,024 tokens) their repetitions spread 40-55% (p10 to
p90, steps.csv); the 8B's same steps spread 2-4%. This probe builds its executor with the mixed
graphs of that engine (token budget 1,024, so steps above it run eagerly) and times a few of
them (and a graphed control) under conditions that separate the candidate causes:

- `same`: one composition back to back; `interleaved`: all of them round-robin, with a
  large step between (as the profiler's rounds run them); `pinned`: interleaved, the process
  pinned to one CPU; `gc_in_step`: interleaved, with Python's garbage collector left on inside
  the step (`GpuExecutor.execute` holds it off since; this calls the step without the hold).

Per step it records the executor's CUDA-event span, the host time until `forward` returned
(the launches: when it is close to the span the step is host-bound), the CPU it ran on, and
the caching allocator's device allocations and frees (a cudaMalloc/cudaFree inside a step
synchronises and stalls). An `nvidia-smi` log at 100 ms runs beside it (smi.csv).
Writes steps.csv and prints medians and p10/p90 per condition and composition.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

IDS = ("mixed/d16c1024/1x1084+p0", "prefill/1x2048+p0", "mixed/d200c512/1x1848+p0",
       "prefill/1x4096+p0", "decode/b64/c512")
BIG = "prefill/1x8192+p0"
EAGER_ABOVE = 1024          # the mixed graphs of the engine the finding was made on


def _cpu() -> int:
    """The CPU this process last ran on (/proc/self/stat field 39), -1 where unknown."""
    try:
        return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def main() -> None:
    import pandas as pd
    import torch
    from simkv.specs import load_model
    from simkv.profile.design import design
    from simkv.gpu.executor import GpuExecutor
    from simkv.gpu.host import nvidia_smi_log
    from simkv.gpu.profiler import _plan, _tokens

    args = _args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with nvidia_smi_log(out / "smi.csv", "timestamp,clocks.sm,power.draw,temperature.gpu,"
                        "utilization.gpu"):
        points = {p.id: p for p in design()}
        ex = GpuExecutor(load_model(args.model), 20_000, args.block_size, device="cuda",
                         max_num_seqs=256, max_num_batched_tokens=EAGER_ABOVE,
                         profile_memory=False)
        with torch.inference_mode():
            ex.caches.normal_()
        rng = np.random.default_rng(0)
        tokens = _tokens(ex, rng)
        plans = {i: _plan(points[i].items, ex.block_size, rng.permutation(ex.num_blocks), tokens)
                 for i in IDS + (BIG,)}
        forward = ex.model.forward
        launched = {}

        def timed_forward(*a, **k):
            result = forward(*a, **k)
            launched["t"] = time.perf_counter()
            return result

        ex.model.forward = timed_forward
        rows = []

        def run(condition, pid, rep):
            stats = torch.cuda.memory_stats()
            launched.pop("t", None)
            t0 = time.perf_counter()
            (ex._execute if condition == "gc_in_step" else ex.execute)(plans[pid])
            t1 = time.perf_counter()
            after = torch.cuda.memory_stats()
            rows.append({"condition": condition, "id": pid, "rep": rep, "unix_s": time.time(),
                         "time_s": ex.last_gpu_s, "wall_s": t1 - t0,
                         "launch_s": launched.get("t", float("nan")) - t0,
                         "prep_s": ex.last_prep_s, "cpu": _cpu(),
                         "device_allocs": (after.get("num_device_alloc", 0)
                                           - stats.get("num_device_alloc", 0)),
                         "device_frees": (after.get("num_device_free", 0)
                                          - stats.get("num_device_free", 0))})

        for pid in plans:                       # warm-up
            for _ in range(2):
                ex.execute(plans[pid])
        _run_conditions(run, lambda: ex.execute(plans[BIG]), args.reps)
    df = pd.DataFrame(rows)
    df.to_csv(out / "steps.csv", index=False)
    _print_report(df)


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def _run_conditions(run, big_step, reps: int) -> None:
    """Each composition back to back (`same`), then the interleaved conditions in order, a large
    step after each composition; `pinned` on the lowest CPU of the process's affinity."""
    cpus = os.sched_getaffinity(0)
    for pid in IDS:
        for rep in range(reps):
            run("same", pid, rep)
    for condition in ("interleaved", "pinned", "gc_in_step", "interleaved"):
        if condition == "pinned":
            os.sched_setaffinity(0, {min(cpus)})
        for rep in range(reps):
            for pid in IDS:
                run(condition, pid, rep)
                big_step()
        os.sched_setaffinity(0, cpus)


def _print_report(df) -> None:
    """Median and p10/p90 per condition and composition, and what the slow steps had."""
    q = df.groupby(["condition", "id"], sort=False).agg(
        ms=("time_s", lambda s: 1e3 * s.median()),
        p10=("time_s", lambda s: 1e3 * s.quantile(0.1)),
        p90=("time_s", lambda s: 1e3 * s.quantile(0.9)),
        launch_ms=("launch_s", lambda s: 1e3 * s.median()),
        allocs=("device_allocs", "sum"), frees=("device_frees", "sum"),
        cpus=("cpu", "nunique"))
    print(q.round(3).to_string())
    slow = df["time_s"] > df.groupby(["condition", "id"])["time_s"].transform("median") * 1.2
    print(f"slow steps (> 1.2 x median): {int(slow.sum())} of {len(df)}; with a device "
          f"alloc/free: {int((slow & ((df.device_allocs + df.device_frees) > 0)).sum())}; "
          f"median launch/span slow {float((df.launch_s / df.time_s)[slow].median()):.2f}, "
          f"others {float((df.launch_s / df.time_s)[~slow].median()):.2f}")


if __name__ == "__main__":
    main()
