"""The profiling pass: the real executor over a designed grid of step compositions.

    python -m simkv.gpu.profiler --model llama-3.1-8b [--block-sizes 8,16,32,64,128] [--out DIR]
        [--parts steps,transfers,ledger,host_noise,engine[,rested][,serving]] [--time-budget-s S]
        [--quick] [--fit]

For each block size a fresh `GpuExecutor` (sample model, paged Triton kernels, CUDA graphs for
decode-only steps as the engine runs them) executes synthetic StepPlans:

- decode-only: batch x context, and heterogeneous contexts in one batch;
- prefill-only: chunk tokens x cached prefix, one or several chunks per step;
- mixed: prefill chunks beside decodes, as chunked prefill schedules them;
- block copies (copy-on-write) and host<->device swaps against blocks per transfer.

The step grid runs a warm-up round over the whole design, then `reps` rounds (at most 3 for
steps over 50 ms), interleaved so that each composition is timed after different ones, as in
serving; the step time is the median of the executor's own CUDA-event span (`last_gpu_s`: host
input building, the forward, sampling and the copy of the sampled tokens back, as in the
engine); `prep_s` is the median host input building inside that span. The `rested` part (a
diagnostic, not in the default set) times each composition again after a short idle
(`rested_s`; `simkv fit` reports its ratio to the grid's times). The `serving` part (not in the
default set; with `engine`) serves a synthetic workload by the wall clock and keeps each step's
host terms (serving_host.csv, `simkv.gpu.engine_pass.measure_serving_host`). Block tables
are random permutations of the pool, whose K/V are random (never zeros). At block size 16 the
profiler also measures the memory ledger (weights, activation peak against batched tokens,
CUDA-graph pool and everything else) and repeats a few steps as they are and pinned to one CPU
(host_noise.csv).

Writes `steps.csv`, `swap.csv`, `copy.csv`, `memory.csv`, `ledger.json`, `host_noise.csv` and
`meta.json` (GPU, driver, versions, clocks observed, date, command) under
`profiles/<gpu>/<model>/`; `simkv fit` turns them into `fit.json`. Torch is imported only when a
profile runs, so the design grid (`design`) is importable anywhere. See docs/profiling.md.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from simkv.sizing import PROFILE_ENGINE_BATCHED_TOKENS
from simkv.errors import InputError
from simkv.gpu.engine_pass import (ENGINE_FIELDS, ENGINE_PASS_NOTE, ENGINE_PASS_REQUESTS,
                                   SERVING_FIELDS, SERVING_LOAD, measure_engine_host,
                                   measure_serving_host, six_digits)
from simkv.gpu.host import frozen_heap, host_conditions, pin_to_cpu
from simkv.profile.design import MAX_CACHED_TOKENS, design, features, step_plan

GIB = 1 << 30
STEP_FIELDS = ["id", "family", "block_size", "num_prefill_tokens", "num_decode_tokens",
               "num_prefill_seqs", "num_decode_seqs", "decode_context_tokens",
               "prefill_context_tokens", "prefill_attention_pairs", "decode_max_context",
               "graph", "time_s", "time_p10_s", "time_p90_s", "wall_s", "reps", "prep_s"]
TRANSFER_FIELDS = ["block_size", "num_blocks", "bytes", "time_s", "time_p10_s", "time_p90_s",
                   "reps"]
LEDGER_BLOCK_SIZE = 16
MAX_NUM_SEQS = 256


# ----------------------------------------------------------------------------------------------
# Running plans


def _plan(items, block_size: int, perm: np.ndarray, tokens: list):
    """A StepPlan of fresh sequences whose block tables take blocks from `perm` in order."""
    tables, used = [], 0
    for start, n, _ in items:
        blocks = -(-(start + n) // block_size)
        tables.append(perm[used:used + blocks].tolist())
        used += blocks
    return step_plan(items, block_size, tables, tokens)


LONG_STEP_S = 0.05       # steps longer than this vary little: at most 3 timed repetitions


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


def profiling_executor(model, num_blocks: int, block_size: int, device, seed: int = 0):
    """A GpuExecutor as the profiler times steps on it: the engine's graph sizes for
    max_num_seqs MAX_NUM_SEQS and 8,192 batched tokens, no swap space, random K/V (never time
    on zeros). The probes in benchmarks/ build theirs here too."""
    import torch
    from simkv.gpu.executor import GpuExecutor
    executor = GpuExecutor(model, num_blocks, block_size, num_host_blocks=0, device=str(device),
                           seed=seed, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=8192,
                           profile_memory=False)
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


def profile_block_size(executor, points, rng, reps: int, log, rested: bool = False) -> list:
    """Time every composition on one executor; rows for steps.csv.

    The repetitions are interleaved: a warm-up round over the whole design, then `reps` timed
    rounds (at most 3 for steps over LONG_STEP_S). A slow spell of the host, or a GPU clock
    state that one kind of step drives (sustained prefills run the SMs hot and slower), then
    shifts one repetition of many compositions instead of every repetition of a few, and each
    composition is timed after a different one, as steps follow each other in serving.

    `rested`: then each composition again after REST_S of idle, RESTED_STEPS steps back to back,
    the fastest as `rested_s`. Meant as the light-work clock's times, it is not that: on the
    H200 decode batches came out 0-3% slower than in the grid, where they run at the top clock
    (the clock climbing back from idle), prefill and mixed steps 4-6% faster
    (docs/profiling.md); a diagnostic of the clock state, which no model uses."""
    bs = executor.block_size
    tokens = _tokens(executor, rng)
    plans, graphed = [], []
    for point in points:                                   # warm-up round
        plan = _plan(point.items, bs, rng.permutation(executor.num_blocks), tokens)
        before = executor.num_graph_steps + executor.num_mixed_graph_steps
        executor.execute(plan)
        graphed.append(int(executor.num_graph_steps + executor.num_mixed_graph_steps > before))
        plans.append(plan)
    times = [[] for _ in points]
    walls = [[] for _ in points]
    preps = [[] for _ in points]
    with frozen_heap():      # as the engine serves: the plans and executor out of collections
        for r in range(reps):
            for i, plan in enumerate(plans):
                if r >= 3 and times[i][0] > LONG_STEP_S:
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


REST_S = 0.1            # the clock probe saw the SM clock back at its top within tens of ms
RESTED_STEPS = 3


def _rested_seconds(executor, plan) -> float:
    """The fastest of RESTED_STEPS steps back to back after REST_S of idle."""
    time.sleep(REST_S)
    times = []
    for _ in range(RESTED_STEPS):
        executor.execute(plan)
        times.append(executor.last_gpu_s)
    return min(times)


def profile_transfers(executor, rng, reps: int, max_bytes: float, log) -> tuple:
    """Rows for swap.csv (both directions) and copy.csv on one executor."""
    from simkv.engine.plan import StepPlan
    bs = executor.block_size
    bytes_per_block = executor.kv_pool_bytes // executor.num_blocks
    counts = (1, 16) if max_bytes < GIB else (1, 4, 16, 64, 256, 1024)
    counts = [n for n in counts if n * bytes_per_block <= max_bytes] or [1]
    swap_rows, copy_rows = [], []
    for n in counts:
        dev = rng.permutation(executor.num_blocks)[:2 * n].tolist()
        out = StepPlan(step=0, now_s=0.0, swap_out=[(d, h) for h, d in enumerate(dev[:n])])
        back = StepPlan(step=0, now_s=0.0, swap_in=[(h, d) for h, d in enumerate(dev[:n])])
        copies = StepPlan(step=0, now_s=0.0, block_copies=list(zip(dev[:n], dev[n:])))
        for direction, plan in (("out", out), ("in", back)):
            row = {"direction": direction, "block_size": bs, "num_blocks": n,
                   "bytes": n * bytes_per_block}
            row.update({k: (six_digits(v) if isinstance(v, float) else v)
                        for k, v in _time(executor, plan, reps, warmup=2).items() if k != "wall_s"})
            swap_rows.append(row)
        row = {"block_size": bs, "num_blocks": n, "bytes": 2 * n * bytes_per_block}
        row.update({k: (six_digits(v) if isinstance(v, float) else v)
                    for k, v in _time(executor, copies, reps).items() if k != "wall_s"})
        copy_rows.append(row)
    log(f"  block size {bs}: swaps and copies up to {counts[-1]} blocks")
    return swap_rows, copy_rows


# ----------------------------------------------------------------------------------------------
# Memory ledger


def measure_ledger(executor, model, token_counts, log, serving: dict | None = None) -> tuple:
    """(ledger dict for ledger.json, rows for memory.csv) from a block-size-16 executor.

    `serving`: the engine pass's ledger (a serving engine after its run). When given, `other`
    is made of its parts (graph pool, memory outside PyTorch, persistent tensors, allocator
    slack at the serving peak); the profiling executor's, measured after a grid of very varied
    shapes, stay beside them as `grid_other_parts` (its slack was 0.7 GiB above a serving
    engine's on the 8B: the tight-budget validation runs)."""
    import torch
    # The engine's ledger first: its run peak is the profiling grid's, not the sweep's below.
    report = executor.ledger.report(executor.weight_bytes, executor.kv_pool_bytes,
                                    int(executor.profile.get("peak_bytes", 0)))
    points = {}
    for n in token_counts:
        prof = executor.profile_activation(n, MAX_NUM_SEQS)
        points[int(prof["tokens"])] = int(prof["peak_bytes"])
    # profile_activation reports the larger of its two forwards (n and n/2): n's peak.
    tokens = np.array(sorted(points), dtype=float)
    peaks = np.array([points[int(t)] for t in tokens], dtype=float)
    slope, base = np.polyfit(tokens, peaks, 1) if len(tokens) > 1 else (0.0, peaks[0])
    slope, base = max(0.0, float(slope)), max(0.0, float(base))
    def parts_of(rep: dict) -> dict:
        return {"cuda_graph_pool_bytes": int(rep["graph_pool_bytes"]),
                "non_torch_bytes": int(rep["non_torch_bytes"]),
                "persistent_other_bytes": int(rep["persistent_other_bytes"]),
                "allocator_slack_bytes": int(max(0, rep["unattributed_bytes"]))}
    grid_parts = parts_of(report)
    other_parts = parts_of(serving) if serving else grid_parts
    ledger = {
        "weights_bytes": int(executor.weight_bytes),
        "activation_bytes_per_batched_token": round(slope, 1),
        "activation_base_bytes": int(base),
        "other_bytes": int(sum(other_parts.values())),
        "other_parts": other_parts,
        "other_source": ("the engine pass: a serving engine's ledger after its run" if serving
                         else "the profiling executor after the step grid"),
        "grid_other_parts": grid_parts,
        "activation_points": [[int(t), int(p)] for t, p in zip(tokens, peaks)],
        "measured_with": {"block_size": executor.block_size, "max_num_seqs": MAX_NUM_SEQS,
                          "max_num_batched_tokens": PROFILE_ENGINE_BATCHED_TOKENS,
                          "max_model_len": executor.max_model_len,
                          "dtype": str(executor.dtype).replace("torch.", ""),
                          "kv_pool_bytes": int(executor.kv_pool_bytes),
                          "device_memory_bytes": report["device_memory_bytes"]},
        "note": ("activation = activation_base_bytes + activation_bytes_per_batched_token x "
                 "max_num_batched_tokens (peak of a forward over that many tokens with "
                 f"{MAX_NUM_SEQS} sampled rows, above the persistent tensors); other = CUDA-graph "
                 "pool + memory outside PyTorch (CUDA context, cuBLAS, Triton modules) + "
                 "persistent small tensors + allocator slack at the peak"),
        "engine_ledger": {k: v for k, v in report.items() if k != "stages"},
        "serving_ledger": serving,
    }
    ledger["estimate_comparison"] = _estimate_comparison(model, ledger)
    torch.cuda.empty_cache()
    log(f"  ledger: weights {ledger['weights_bytes'] / GIB:.2f} GiB, activation "
        f"{slope:.0f} B/token + {base / 2**20:.0f} MiB, "
        f"other {ledger['other_bytes'] / GIB:.2f} GiB")
    rows = [{"num_batched_tokens": int(t), "peak_activation_bytes": int(p)}
            for t, p in zip(tokens, peaks)]
    return ledger, rows


def _estimate_comparison(model, ledger: dict) -> dict:
    """Measured vs the foundation's estimate (simkv.sizing) at the default settings."""
    import simkv.sizing as sizing
    from simkv.config.scenario import SchedulerConfig
    sched = SchedulerConfig()
    estimate = {
        "weights_bytes": model.weight_bytes(sizing.WEIGHT_DTYPE_BYTES),
        "activation_bytes": sizing.estimate_activation_bytes(model, sched),
        "other_bytes": sizing.CUDA_CONTEXT_BYTES + sizing.estimate_graph_pool_bytes(model, sched)
        + sizing.ALLOCATOR_SLACK_BYTES,
    }
    measured = {
        "weights_bytes": ledger["weights_bytes"],
        "activation_bytes": int(ledger["activation_base_bytes"]
                                + ledger["activation_bytes_per_batched_token"]
                                * sched.max_num_batched_tokens),
        "other_bytes": ledger["other_bytes"],
    }
    return {"max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs, "estimate": estimate, "measured": measured,
            "measured_minus_estimate": {k: int(measured[k] - estimate[k]) for k in estimate}}


# ----------------------------------------------------------------------------------------------
# Metadata


def _nvidia_smi() -> dict:
    fields = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    if not out:
        return {}
    values = [v.strip() for v in out.splitlines()[0].split(",")]
    return dict(zip(fields.split(","), values))


def gpu_short_name(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200': the bundled GPU whose name appears in the device's name."""
    from simkv.specs import bundled_gpus
    text = device_name.lower().replace("-", " ")
    for name in sorted(bundled_gpus(), key=len, reverse=True):
        if name.split("-")[0] in text.split():
            return name
    return text.replace("nvidia", "").strip().split()[0] if text.strip() else "unknown"


def _meta(model, device, executor_dtype, block_sizes, quick, graph_sizes, command,
          smi_before=None) -> dict:
    import torch
    import triton
    meta = {
        "model": model.name,
        "model_shape": {k: getattr(model, k) for k in (
            "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
            "intermediate_size", "vocab_size")},
        "kv_bytes_per_token": model.kv_bytes_per_token("bf16"),
        "dtype": str(executor_dtype).replace("torch.", ""),
        "kv_dtype": "bf16" if executor_dtype == torch.bfloat16 else str(executor_dtype),
        "block_sizes": list(block_sizes),
        "graph_batch_sizes": list(graph_sizes),
        "quick": quick,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy": np.__version__,
        "host": platform.node(),
        "timing": ("median of the executor's CUDA-event span of execute(plan): a warm-up round "
                   "over the whole design, then interleaved timed rounds (at most 3 repetitions "
                   "for steps over 50 ms); p10/p90 beside it"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update({"device_name": props.name, "gpu": gpu_short_name(props.name),
                     "sm_count": props.multi_processor_count,
                     "device_memory_bytes": int(props.total_memory),
                     "cuda": torch.version.cuda, "nvidia_smi_before": smi_before or {}})
    else:
        meta.update({"device_name": platform.processor() or "cpu", "gpu": "cpu"})
    return meta


def _write_csv(path: Path, rows: list, fields: list) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


# ----------------------------------------------------------------------------------------------
# The pass


PARTS = ("steps", "transfers", "ledger", "host_noise", "engine")      # the default set
OPTIONAL_PARTS = ("rested", "serving")
NOISE_IDS = ("prefill/1x16+p0", "prefill/1x512+p0", "mixed/d32c1024/1x64+p0",
             "mixed/d128c1024/1x512+p2048", "decode/b64/c512")
LEDGER_WARM_IDS = ("prefill/1x8192+p0", "mixed/d200c512/1x1848+p0", "decode/b256/c512")


def run_profile(model_name, block_sizes=(8, 16, 32, 64, 128), out_dir=None, quick: bool = False,
                device: str | None = None, seed: int = 0, reps: int | None = None,
                time_budget_s: float | None = None, parts=PARTS, log=print,
                pin_cpu: int | None = None) -> Path:
    """Profile `model_name` (bundled name or config path) and write the raw data; returns the dir.

    `parts`: any of "steps" (the step grid, every block size), "rested" (with "steps": each
    composition again after a rest, `rested_s`; a diagnostic), "serving" (with "engine", CUDA
    only: the engine serving by the wall clock, serving_host.csv), "transfers" (swaps and copies,
    every block size), "ledger" and "host_noise" (CUDA only, at block size 16). `quick`: the CI
    smoke test (a handful of tiny compositions; use it with the `tiny` model on CPU, float64
    and the reference attention). Default out_dir: profiles/<gpu>/<model>/. The files are
    rewritten after every block size; with `time_budget_s`, block sizes that would not finish
    in time are skipped (and left out of meta.json's `block_sizes`). meta.json is written when
    the step grid is measured, `meta-partial.json` otherwise. `pin_cpu`: run pinned to this CPU
    (simkv.gpu.host; then run the validation engine pinned too).
    """
    import torch
    from simkv.specs import load_model, profiles_dir

    started = time.perf_counter()
    pin_to_cpu(pin_cpu)
    model = load_model(model_name)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    reps = reps or (2 if quick else 5)
    points = design(quick)
    max_tokens = max(sum(s + n for s, n, _ in p.items) for p in points)
    max_seqs = max(len(p.items) for p in points)
    rng = np.random.default_rng(seed)
    command = " ".join(["simkv profile"] + sys.argv[1:]) if sys.argv and sys.argv[0] else None
    if not ("steps" in parts or "transfers" in parts):
        block_sizes = [b for b in block_sizes if b == LEDGER_BLOCK_SIZE] or [LEDGER_BLOCK_SIZE]

    out = Path(out_dir) if out_dir is not None else None
    smi_before = _nvidia_smi() if cuda else {}
    data = {"steps": [], "swaps": [], "copies": [], "memory": [], "ledger": None, "noise": [],
            "engine": [], "serving_ledger": None, "serving": []}
    graph_sizes, mixed_sizes, dtype, tile, prefill_tile = [], [], None, None, None
    done, longest = [], 0.0
    # The engine pass first: the serving engine's memory (its allocator slack at the peak is what
    # sizing subtracts) is measured with the process's first executor (a later one can find
    # 0.8-2 GiB left behind by earlier ones; docs/profiling.md). Then the ledger's block size.
    if "engine" in parts and cuda:
        data["engine"], data["serving_ledger"] = measure_engine_host(
            model, dev, seed, log, gpu=gpu_short_name(torch.cuda.get_device_name(dev)),
            max_num_seqs=MAX_NUM_SEQS)
    block_sizes = sorted(block_sizes, key=lambda b: b != LEDGER_BLOCK_SIZE)
    for bs in block_sizes:
        if time_budget_s and done and time.perf_counter() - started + longest > time_budget_s:
            log(f"  time budget of {time_budget_s:.0f} s reached: block sizes "
                f"{[b for b in block_sizes if b not in done]} not profiled")
            break
        bs_start = time.perf_counter()
        num_blocks = -(-max_tokens // bs) + max_seqs + 16
        executor = profiling_executor(model, num_blocks, bs, dev, seed)
        dtype = executor.dtype
        graph_sizes = executor.steps.decode_buckets() if executor.use_graphs else []
        mixed_sizes = executor.steps.mixed_buckets() if executor.use_graphs else []
        if executor.attention == "triton":
            from simkv.gpu import kernels
            tile = kernels.decode_config(bs, model.head_dim, dtype).tile
            prefill_tile = kernels.prefill_config(model.head_dim, dtype).block_m
        if "steps" in parts:
            data["steps"] += profile_block_size(executor, points, rng, reps, log,
                                                rested="rested" in parts)
        if "transfers" in parts:
            s, c = profile_transfers(executor, rng, reps, 64 * 2**20 if quick else GIB, log)
            data["swaps"] += s
            data["copies"] += c
        if cuda and bs == LEDGER_BLOCK_SIZE and "host_noise" in parts:
            data["noise"] = measure_host_noise(executor, points, rng, log)
        if cuda and bs == LEDGER_BLOCK_SIZE and "ledger" in parts:
            if "steps" not in parts:        # the run peak should be a serving-like one
                for point in points:
                    if point.id in LEDGER_WARM_IDS:
                        executor.execute(_plan(point.items, bs,
                                               rng.permutation(executor.num_blocks),
                                               _tokens(executor, rng)))
            data["ledger"], data["memory"] = measure_ledger(executor, model,
                                                            (2048, 8192, 16384), log,
                                                            data.get("serving_ledger"))
        del executor
        if cuda:
            gc.collect()       # the executor's graphs hold reference cycles
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
        done.append(bs)
        longest = max(longest, time.perf_counter() - bs_start)
        meta = _meta(model, dev, dtype, sorted(done), quick, graph_sizes, command, smi_before)
        if data["engine"]:
            meta["engine_pass"] = ENGINE_PASS_NOTE
        meta.update(host_conditions=host_conditions(), parts=list(parts), decode_tile=tile,
                    prefill_tile=prefill_tile, max_num_seqs=MAX_NUM_SEQS,
                    mixed_token_sizes=list(mixed_sizes),
                    max_model_len=model.max_position_embeddings,
                    profile_seconds=round(time.perf_counter() - started, 1))
        out = out or profiles_dir() / meta["gpu"] / model.name
        _write(out, meta, data)   # after every block size
        log(f"  {meta['profile_seconds']:.0f} s elapsed")
    if "serving" in parts and data["engine"]:
        # last, so that its engine leaves nothing behind for the ledger's executor; arrivals at
        # SERVING_LOAD of what the offline pass served per second
        offline_rps = ENGINE_PASS_REQUESTS / sum(float(r["duration_s"]) for r in data["engine"])
        data["serving"], meta["serving_pass"] = measure_serving_host(
            model, dev, seed, log, SERVING_LOAD * offline_rps,
            gpu=gpu_short_name(torch.cuda.get_device_name(dev)), max_num_seqs=MAX_NUM_SEQS)
        meta["serving_pass"]["offline_throughput_rps"] = round(offline_rps, 3)
        meta["profile_seconds"] = round(time.perf_counter() - started, 1)
    if cuda:
        meta["nvidia_smi_after"] = _nvidia_smi()
        _write(out, meta, data)
    log(f"wrote {out} ({len(data['steps'])} step rows, {meta['profile_seconds']} s)")
    return out


def measure_host_noise(executor, points, rng, log, reps: int = 8, rounds: int = 2) -> list:
    """Repeated timings of a few compositions (graphed since mixed graphs reach 2,048 tokens)
    under two conditions, interleaved: as is, and pinned to one CPU (the same when the profile
    itself runs pinned). Rows for host_noise.csv: condition, id, round, rep, time_s, wall_s.
    (Profiles before the fifth of 2026-11-29 have a third, `gc_off`; execute() now holds
    collection off in every step.)"""
    import os
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


def _write(out: Path, meta: dict, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    parts = meta.get("parts", PARTS)
    if "steps" in parts:
        rested = ["rested_s"] if any("rested_s" in row for row in data["steps"]) else []
        _write_csv(out / "steps.csv", data["steps"], STEP_FIELDS + rested)
    if "transfers" in parts:
        _write_csv(out / "swap.csv", data["swaps"], ["direction"] + TRANSFER_FIELDS)
        _write_csv(out / "copy.csv", data["copies"], TRANSFER_FIELDS)
    if data["ledger"] is not None:
        _write_csv(out / "memory.csv", data["memory"],
                   ["num_batched_tokens", "peak_activation_bytes"])
        ledger = dict(data["ledger"], measured={k: meta.get(k) for k in (
            "date", "command", "device_name", "torch", "triton", "cuda")})
        (out / "ledger.json").write_text(json.dumps(ledger, indent=1) + "\n")
    if data.get("engine"):
        _write_csv(out / "engine_host.csv", data["engine"], ENGINE_FIELDS)
    if data.get("serving"):
        _write_csv(out / "serving_host.csv", data["serving"], SERVING_FIELDS)
    if data["noise"]:
        _write_csv(out / "host_noise.csv", data["noise"],
                   ["condition", "id", "round", "rep", "time_s", "wall_s"])
    name = "meta.json" if "steps" in parts else "meta-partial.json"
    (out / name).write_text(json.dumps(meta, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simkv.gpu.profiler", description=__doc__
                                     .split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--block-sizes", default="8,16,32,64,128")
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", default=None)
    parser.add_argument("--time-budget-s", type=float, default=None)
    parser.add_argument("--reps", type=int, default=None,
                        help="timed rounds over the design (default 5; at most 3 for steps "
                             "over 50 ms)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="comma-separated: " + ", ".join(PARTS + OPTIONAL_PARTS))
    parser.add_argument("--fit", action="store_true", help="run `simkv fit` on the result")
    parser.add_argument("--pin-cpu", type=int, default=None, metavar="N",
                        help="run pinned to CPU N (run the validation engine pinned as well)")
    args = parser.parse_args(argv)
    sizes = tuple(int(b) for b in args.block_sizes.split(","))
    parts = tuple(p for p in args.parts.split(",") if p)
    unknown = [p for p in parts if p not in PARTS + OPTIONAL_PARTS]
    if args.reps is not None and args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)} "
                     f"(choose from {', '.join(PARTS + OPTIONAL_PARTS)})")
    if "rested" in parts and "steps" not in parts:
        parser.error("the rested part times the step grid again: it needs the steps part")
    if "serving" in parts and "engine" not in parts:
        parser.error("the serving part sets its arrival rate from the engine pass: it needs the "
                     "engine part")
    try:
        out = run_profile(args.model, sizes, args.out, args.quick, args.device,
                          reps=args.reps, time_budget_s=args.time_budget_s, parts=parts,
                          pin_cpu=args.pin_cpu)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.fit and "steps" in parts:
        from simkv.fitting.fit import fit_profile
        fit = fit_profile(out)
        print(json.dumps({"holdout_error": {k: fit["holdout_error"][k]
                                            for k in ("median", "p95", "max", "count")},
                          "form": fit["form"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
