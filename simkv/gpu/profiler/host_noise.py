"""Host noise: a few compositions timed again and again, as they are and pinned to one CPU
(host_noise.csv)."""
from __future__ import annotations

import os
import time

from simkv.gpu.engine_pass import six_digits
from simkv.gpu.profiler.grid import _plan, _tokens

NOISE_IDS = ("prefill/1x16+p0", "prefill/1x512+p0", "mixed/d32c1024/1x64+p0",
             "mixed/d128c1024/1x512+p2048", "decode/b64/c512")
NOISE_FIELDS = ["condition", "id", "round", "rep", "time_s", "wall_s"]


def measure_host_noise(executor, points, rng, log, reps: int = 8, rounds: int = 2) -> list:
    """Repeated timings of a few compositions (graphed since mixed graphs reach 2,048 tokens)
    under two conditions, interleaved: as is, and pinned to one CPU (the same when the profile
    itself runs pinned). Rows for host_noise.csv: condition, id, round, rep, time_s, wall_s.
    There is no garbage-collection condition: execute() holds collection off in every step."""
    chosen = [p for p in points if p.id in NOISE_IDS]
    tokens = _tokens(executor, rng)
    plans = {p.id: _plan(p.items, executor.block_size, rng.permutation(executor.num_blocks),
                         tokens) for p in chosen}
    can_pin = hasattr(os, "sched_getaffinity")
    cpus = os.sched_getaffinity(0) if can_pin else None
    rows = []
    for rnd in range(rounds):
        for condition in ("default", "one_cpu"):
            if condition == "one_cpu" and not can_pin:
                continue
            if condition == "one_cpu":
                os.sched_setaffinity(0, {min(cpus)})
            try:
                for pid, plan in plans.items():
                    executor.execute(plan)
                    for rep in range(reps):
                        t0 = time.perf_counter()
                        executor.execute(plan)
                        rows.append({"condition": condition, "id": pid, "round": rnd,
                                     "rep": rep, "time_s": six_digits(executor.last_gpu_s),
                                     "wall_s": six_digits(time.perf_counter() - t0)})
            finally:
                if can_pin:
                    os.sched_setaffinity(0, cpus)
    log(f"  host noise: {len(rows)} timings")
    return rows
