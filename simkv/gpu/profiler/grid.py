"""The step grid: the profiling executor, synthetic StepPlans on it, and their timing."""
from __future__ import annotations

import time

import numpy as np

from simkv.gpu.engine_pass import six_digits
from simkv.gpu.host import frozen_heap
from simkv.gpu.profiler.parts import MAX_NUM_SEQS
from simkv.profile.design import MAX_CACHED_TOKENS, features, step_plan
from simkv.sizing import PROFILE_ENGINE_BATCHED_TOKENS

STEP_FIELDS = ["id", "family", "block_size", "num_prefill_tokens", "num_decode_tokens",
               "num_prefill_seqs", "num_decode_seqs", "decode_context_tokens",
               "prefill_context_tokens", "prefill_attention_pairs", "decode_max_context",
               "graph", "time_s", "time_p10_s", "time_p90_s", "wall_s", "reps", "prep_s"]
LONG_STEP_S = 0.05       # steps longer than this vary little: at most 3 timed repetitions
REST_S = 0.1            # the clock probe saw the SM clock back at its top within tens of ms
RESTED_STEPS = 3


def _plan(items, block_size: int, perm: np.ndarray, tokens: list):
    """A StepPlan of fresh sequences whose block tables take blocks from `perm` in order."""
    tables, used = [], 0
    for start, n, _ in items:
        blocks = -(-(start + n) // block_size)
        tables.append(perm[used:used + blocks].tolist())
        used += blocks
    return step_plan(items, block_size, tables, tokens)


def _time(executor, plan, reps: int, warmup: int = 1) -> dict:
    """Median (and p10/p90) of the executor's CUDA-event span over `reps` runs after warm-up."""
    for _ in range(warmup):
        executor.execute(plan)
    times, walls = [], []
    while len(times) < reps:
        t0 = time.perf_counter()
        executor.execute(plan)
        walls.append(time.perf_counter() - t0)
        times.append(executor.last_gpu_s)
        if times[0] > LONG_STEP_S:
            reps = min(reps, 3)
    return _summary(times, walls)


def profile_kv_groups(model, block_size: int):
    """The `kv_groups` the engine's executor gets for `model` at `block_size` and the profile's
    scheduler settings (simkv.gpu.engine `engine_kv_groups` of that sizing): the KV cache groups
    of a window hybrid, None for a model of one group. Which layers share a group depends on the
    model and the block size only, so the GPU the sizing is for does not matter."""
    from simkv.config.sections import CacheConfig, SchedulerConfig
    from simkv.gpu.engine import engine_kv_groups
    from simkv.sizing import size_pool
    from simkv.specs import load_gpu
    scheduler = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS,
                                max_num_batched_tokens=PROFILE_ENGINE_BATCHED_TOKENS)
    sizing = size_pool(model, load_gpu("h200"), CacheConfig(block_size=block_size), scheduler)
    return engine_kv_groups(sizing)


def profiling_executor(model, num_blocks: int, block_size: int, device, seed: int = 0,
                       model_factory=None):
    """A GpuExecutor as the profiler times steps on it: the engine's graph sizes for
    max_num_seqs MAX_NUM_SEQS and 8,192 batched tokens, no swap space, random K/V (never time
    on zeros). The probes in benchmarks/ build theirs here too. `model_factory`: a
    tensor-parallel rank's shards (simkv.gpu.tensor_parallel.model_factory).

    A window hybrid gets the engine's KV cache groups (`profile_kv_groups`), so its steps fill
    the per-group slot mappings and block tables of the fixed-shape steps and run as CUDA graphs,
    as served. The profile's synthetic sequences have no KV manager, so every group uses the
    sequence's whole table (GpuExecutor `kv_groups`): each group's layers write and read the
    same blocks (in their own cache slots' memory), the full layers over the whole context and
    the sliding ones over their window only (the kernels visit no page before a query's window),
    the pages a served step reads."""
    import torch
    from simkv.gpu.executor import GpuExecutor
    executor = GpuExecutor(model, num_blocks, block_size, num_host_blocks=0, device=str(device),
                           seed=seed, max_num_seqs=MAX_NUM_SEQS,
                           max_num_batched_tokens=PROFILE_ENGINE_BATCHED_TOKENS,
                           profile_memory=False,
                           model_factory=model_factory,
                           kv_groups=profile_kv_groups(model, block_size))
    with torch.inference_mode():
        executor.caches.normal_()
    return executor


def _tokens(executor, rng) -> list:
    """Random token ids, enough for the longest sequence of the design."""
    return rng.integers(0, executor.spec.vocab_size, MAX_CACHED_TOKENS + 65536).tolist()


def _summary(times: list, walls: list) -> dict:
    t = np.array(times)
    return {"time_s": float(np.median(t)), "time_p10_s": float(np.percentile(t, 10)),
            "time_p90_s": float(np.percentile(t, 90)), "wall_s": float(np.median(walls)),
            "reps": len(times)}


def profile_block_size(executor, points, rng, reps: int, log, rested: bool = False,
                       agree=None) -> list:
    """Time every composition on one executor; rows for steps.csv.

    The repetitions are interleaved: a warm-up round over the whole design, then `reps` timed
    rounds (at most 3 for steps over LONG_STEP_S). A slow spell of the host, or a GPU clock
    state that one kind of step drives (sustained prefills run the SMs hot and slower), then
    shifts one repetition of many compositions instead of every repetition of a few, and each
    composition is timed after a different one, as steps follow each other in serving.

    `rested`: then each composition again after REST_S of idle, RESTED_STEPS steps back to back,
    the fastest as `rested_s`: a diagnostic of the clock state, which no model uses (what it
    showed on the H200 is in docs/profiling.md). `agree(values) -> values`: on a tensor-parallel
    rank, rank 0's decision of which steps are long (every rank must run the same steps)."""
    bs = executor.block_size
    plans, graphed = _warm_up(executor, points, rng)
    times = [[] for _ in points]
    walls = [[] for _ in points]
    preps = [[] for _ in points]
    with frozen_heap():      # as the engine serves: the plans and executor out of collections
        long = []
        for r in range(reps):
            if r == 3:
                long = [t[0] > LONG_STEP_S for t in times]
                long = agree(long) if agree is not None else long
            for i, plan in enumerate(plans):
                if r >= 3 and long[i]:
                    continue
                t0 = time.perf_counter()
                executor.execute(plan)
                walls[i].append(time.perf_counter() - t0)
                times[i].append(executor.last_gpu_s)
                preps[i].append(executor.last_prep_s)
        rested_s = [_rested_seconds(executor, plan) for plan in plans] if rested else None
    rows = []
    for i, point in enumerate(points):
        row = {"id": point.id, "family": point.family, "block_size": bs,
               **features(point.items), "graph": graphed[i]}
        row.update({k: (six_digits(v) if isinstance(v, float) else v)
                    for k, v in _summary(times[i], walls[i]).items()})
        row["prep_s"] = six_digits(float(np.median(preps[i])))
        if rested:
            row["rested_s"] = six_digits(rested_s[i])
        rows.append(row)
    log(f"  block size {bs}: {len(rows)} compositions")
    return rows


def _warm_up(executor, points, rng) -> tuple:
    """The warm-up round: (each composition's plan, 1 where it ran as a CUDA graph else 0)."""
    bs = executor.block_size
    tokens = _tokens(executor, rng)
    plans, graphed = [], []
    for point in points:
        plan = _plan(point.items, bs, rng.permutation(executor.num_blocks), tokens)
        before = executor.num_graph_steps + executor.num_mixed_graph_steps
        executor.execute(plan)
        graphed.append(int(executor.num_graph_steps + executor.num_mixed_graph_steps > before))
        plans.append(plan)
    return plans, graphed


def _rested_seconds(executor, plan) -> float:
    """The fastest of RESTED_STEPS steps back to back after REST_S of idle."""
    time.sleep(REST_S)
    times = []
    for _ in range(RESTED_STEPS):
        executor.execute(plan)
        times.append(executor.last_gpu_s)
    return min(times)
