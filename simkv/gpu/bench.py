"""Kernel benchmark: the paged kernels against torch SDPA on contiguous KV, on one CUDA GPU.

    python -m simkv.gpu.bench kernels [--out profiles/h200/kernels.csv] [--quick]
                                      [--block-sizes 16] [--time-budget-s S] [--configs best.json]
    python -m simkv.gpu.bench tune [--out DIR] [--quick] [--time-budget-s S]

`kernels` writes one CSV row per (kernel, batch, context, block size) with the columns of
`COLUMNS` (then extra columns), a metadata JSON beside it (GPU, driver, versions, date, command),
and prints the target points. Shapes: 32 query heads, 8 KV heads, head_dim 128, bfloat16; the
block table is a random permutation of the cache's blocks. Bytes counted per call: K and V read
once, q read and out written once. The baseline is torch SDPA over contiguous
[batch, kv_heads, context, head_dim] K/V of the same shape in the same run; of the ways to call
it (decode: query heads folded into the query length, or `enable_gqa`; prefill: `enable_gqa`, or
K/V expanded to all heads) the fastest is kept and named in `baseline_variant`.

Two timings, each for our kernel and for the baseline:

* per call (`time_us`, `tbps`, `baseline_time_us`, `baseline_tbps`): one call captured in a CUDA
  graph, its replays timed by `triton.testing.do_bench` (CUDA events, L2 flushed before each
  replay, median). Each replay pays the graph's launch and a cold L2, so a small call shows a
  floor of several microseconds that is not the kernel's own.
* steady state (`steady_time_us`, `steady_tbps`, `baseline_steady_time_us`,
  `baseline_steady_tbps`): `steady_calls` calls back to back in ONE CUDA graph, cycling over
  `steady_sets` input sets (own q, KV cache, block table, output) whose KV bytes together exceed
  `STEADY_MIN_BYTES` (twice an H200's 50 MB L2), so that no call finds its KV in L2; replays are
  timed with CUDA events, and the per-call time is the median replay time / `steady_calls`. This
  is the rate at which an engine replaying a graph of many layers runs the kernel.

`tune` sweeps launch parameters (decode split policy and merge, prefill tiles) and writes
`tune.csv` (every measurement) and `best.json` (the choices, usable as `kernels --configs`, with
the constants to set in the code) under --out; --quick bounds it to a few minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

COLUMNS = [
    "kernel", "batch", "context", "block_size", "num_heads", "num_kv_heads", "head_dim", "dtype",
    "time_us", "tbps", "baseline", "baseline_time_us", "baseline_tbps",
]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (512, 2048, 4096, 16384)
BLOCK_SIZES = (8, 16, 32, 64, 128)
# (batch, new tokens per sequence, cached prefix tokens per sequence)
PREFILL_POINTS = ((1, 2048, 0), (8, 512, 0), (8, 2048, 0), (32, 512, 0), (4, 4096, 0),
                  (1, 2048, 2048), (8, 512, 2048), (8, 2048, 2048))
QUICK_BATCHES, QUICK_CONTEXTS = (1, 64, 128), (4096,)
QUICK_PREFILL_POINTS = ((8, 2048, 0), (8, 2048, 2048))
# The target points, measured first so that a time budget never drops them.
TARGET_DECODE = ((1, 4096), (8, 4096), (64, 4096), (128, 4096))
TARGET_PREFILL = ((8, 2048, 0),)
MAX_KV_BYTES = 40e9
DEFAULT_OUT = "profiles/h200/kernels.csv"
# Steady-state timing: calls per graph, and KV bytes the rotating input sets must span (twice
# an H200's 50 MB L2), with a cap on the number of sets.
STEADY_CALLS = 20
STEADY_MIN_BYTES = 100e6
STEADY_MAX_SETS = 16
STEADY_GRAPH_US = 20_000.0   # fewer calls per graph when one call is long
# Launch-parameter overrides from `tune` (--configs); empty: the kernels' own defaults.
TUNED: dict = {}


def time_us(fn, graph: bool = True) -> float:
    """Median time of one fn() call in microseconds.

    With `graph`, the call is captured once in a CUDA graph and the replays are timed, so the
    number is device time without Python/launch overhead (as in an engine that replays graphs).
    triton.testing.do_bench times each call with CUDA events and flushes the L2 cache before it.
    """
    import triton.testing

    run = fn
    if graph:
        fn()
        torch.cuda.synchronize()
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        except RuntimeError as e:  # not capturable: time it eagerly rather than not at all
            print(f"  graph capture failed, timing eagerly: {str(e).splitlines()[0][:100]}", file=sys.stderr)
            torch.cuda.synchronize()
    return triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median") * 1e3


def steady_sets(nbytes: float) -> int:
    """Input sets to rotate over so that their KV bytes together reach STEADY_MIN_BYTES."""
    return int(max(1, min(STEADY_MAX_SETS, math.ceil(STEADY_MIN_BYTES / max(nbytes, 1.0)))))


def steady_time_us(calls: list[Callable], per_call_hint_us: float | None = None) -> tuple[float, int]:
    """Per-call time (µs) of the calls run back to back, and how many calls the graph held.

    One CUDA graph holds K calls cycling over `calls` (one per input set; K = STEADY_CALLS, fewer
    for calls longer than STEADY_GRAPH_US / STEADY_CALLS, never fewer than the sets); its replays
    are timed with CUDA events, one replay per measurement, and the median is divided by K.
    """
    k = STEADY_CALLS
    if per_call_hint_us:
        k = min(k, max(3, math.ceil(STEADY_GRAPH_US / per_call_hint_us)))
    k = max(k, len(calls))
    for call in calls:  # compile, allocate, warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(k):
            calls[i % len(calls)]()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    reps, spent_ms = 3, 0.0
    while len(times) < reps:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if len(times) == 3:  # first replays warm the graph; then ~0.1 s of replays, 5..50 of them
            spent_ms = statistics.median(times)
            reps = 3 + int(max(5, min(50, 100.0 / max(spent_ms, 1e-3))))
    del graph
    return statistics.median(times[3:]) * 1e3 / k, k


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@dataclass
class Contiguous:
    """Contiguous q/K/V of one benchmark point, the SDPA baseline's time and output."""

    q: torch.Tensor  # decode [B, H, D]; prefill [B, H, new, D]
    k: torch.Tensor  # [B, KVH, context, D]
    v: torch.Tensor
    baseline_us: float
    baseline_variant: str
    expected: torch.Tensor  # in the kernel's q layout
    # The chosen variant: prepare(k, v) -> its K/V operands (once, outside timing); call(q, kv).
    prepare: Callable = None
    call: Callable = None


def _fastest(variants: dict, q, k, v) -> tuple[float, str, torch.Tensor, Callable, Callable]:
    """Time each (prepare, call) variant that runs; return the fastest's (time_us, name, output,
    prepare, call)."""
    best = None
    for name, (prepare, call) in variants.items():
        try:
            kv = prepare(k, v)
            result = call(q, kv)
            t = time_us(lambda: call(q, kv))
        except RuntimeError as e:  # a backend that refuses this shape
            print(f"  sdpa variant {name} failed: {str(e).splitlines()[0][:120]}", file=sys.stderr)
            continue
        if best is None or t < best[0]:
            best = (t, name, result, prepare, call)
        del kv
    if best is None:
        raise RuntimeError("no SDPA variant ran")
    return best


def _as_is(k, v):
    return k, v


def _expanded(k, v):
    group = NUM_HEADS // NUM_KV_HEADS
    return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


def decode_setup(batch: int, context: int, device) -> Contiguous:
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=device, dtype=DTYPE)
    v = torch.randn_like(k)
    group = NUM_HEADS // NUM_KV_HEADS
    t, name, out, prepare, call = _fastest({
        "heads_as_queries": (_as_is, lambda q, kv: F.scaled_dot_product_attention(
            q.view(q.shape[0], NUM_KV_HEADS, group, HEAD_DIM), *kv)),
        "enable_gqa": (_as_is, lambda q, kv: F.scaled_dot_product_attention(q.unsqueeze(2), *kv, enable_gqa=True)),
    }, q, k, v)
    return Contiguous(q, k, v, t, name, out.reshape(batch, NUM_HEADS, HEAD_DIM), prepare, call)


def prefill_setup(batch: int, new_tokens: int, cached_tokens: int, device) -> Contiguous:
    from torch.nn.attention.bias import causal_lower_right

    context = new_tokens + cached_tokens
    q = torch.randn(batch, NUM_HEADS, new_tokens, HEAD_DIM, device=device, dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=device, dtype=DTYPE)
    v = torch.randn_like(k)
    if cached_tokens == 0:
        variants = {
            "enable_gqa": (_as_is, lambda q, kv: F.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=True)),
            "expanded_kv": (_expanded, lambda q, kv: F.scaled_dot_product_attention(q, *kv, is_causal=True)),
        }
    else:
        mask = causal_lower_right(new_tokens, context)
        variants = {
            "enable_gqa": (_as_is, lambda q, kv: F.scaled_dot_product_attention(q, *kv, attn_mask=mask, enable_gqa=True)),
            "expanded_kv": (_expanded, lambda q, kv: F.scaled_dot_product_attention(q, *kv, attn_mask=mask)),
        }
    t, name, out, prepare, call = _fastest(variants, q, k, v)
    expected = out.transpose(1, 2).reshape(batch * new_tokens, NUM_HEADS, HEAD_DIM)
    return Contiguous(q, k, v, t, name, expected, prepare, call)


def baseline_steady(setup: Contiguous, nbytes: float) -> tuple[float, int, int]:
    """Steady-state time (µs per call) of the setup's SDPA variant over rotating input sets;
    returns (time, calls per graph, sets). Set 0 is the setup's own tensors, the others copies."""
    sets = []
    for r in range(steady_sets(nbytes)):
        if r == 0:
            q, k, v = setup.q, setup.k, setup.v
        else:
            q, k, v = torch.randn_like(setup.q), setup.k.clone(), setup.v.clone()
        sets.append((q, setup.prepare(k, v)))
    calls = [lambda q=q, kv=kv: setup.call(q, kv) for q, kv in sets]
    t, k = steady_time_us(calls, setup.baseline_us)
    return t, k, len(sets)


def paged_copy(k: torch.Tensor, v: torch.Tensor, block_size: int, gen: torch.Generator):
    """The contiguous K/V scattered into a paged cache through a shuffled block table."""
    batch, _, context, _ = k.shape
    per_seq = context // block_size
    num_blocks = batch * per_seq
    table = torch.randperm(num_blocks, device=k.device, generator=gen).view(batch, per_seq)
    caches = []
    for x in (k, v):
        cache = torch.empty(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, device=k.device, dtype=x.dtype)
        cache[table.reshape(-1)] = x.transpose(1, 2).reshape(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        caches.append(cache)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=k.device)
    return caches[0], caches[1], table.to(torch.int32), seq_lens


def decode_bytes(batch: int, context: int) -> int:
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM
    return (kv + 2 * batch * NUM_HEADS * HEAD_DIM) * DTYPE.itemsize


def prefill_bytes(batch: int, new_tokens: int, cached_tokens: int) -> int:
    kv = 2 * batch * (new_tokens + cached_tokens) * NUM_KV_HEADS * HEAD_DIM
    return (kv + 2 * batch * new_tokens * NUM_HEADS * HEAD_DIM) * DTYPE.itemsize


def prefill_flops(batch: int, new_tokens: int, cached_tokens: int) -> float:
    """2 matmuls × 2 flops per multiply-add over the (query, key) pairs the causal mask keeps."""
    pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
    return 4.0 * HEAD_DIM * NUM_HEADS * batch * pairs


def _rotation(setup: Contiguous, paged, nbytes: float, gen) -> list:
    """Input sets for steady timing: set 0 = (setup.q, paged), then fresh q and paged copies."""
    sets = [(setup.q, paged)]
    for _ in range(1, steady_sets(nbytes)):
        sets.append((torch.randn_like(setup.q), paged_copy(setup.k, setup.v, paged[0].shape[1], gen)))
    return sets


def time_decode(setup: Contiguous, paged, config=None, num_splits=None, eager: bool = False,
                steady: bool = True, per_call: bool = True, gen=None, sets=None) -> dict:
    """Measure the decode kernel on a paged copy of `setup`: rel_err against SDPA's output, then
    the per-call time, the eager time, and the steady time over `sets` (default: a rotation made
    with `gen`) as asked."""
    from simkv.gpu.kernels import decode_config, decode_num_splits, decode_workspace_numel, paged_decode_attention
    from simkv.gpu.kernels._common import sm_count

    k_cache, v_cache, table, seq_lens = paged
    batch, block_size = setup.q.shape[0], k_cache.shape[1]
    cfg = config or TUNED.get("decode_configs", {}).get(block_size) or decode_config(block_size, HEAD_DIM, DTYPE)
    if num_splits is None:
        num_splits = decode_num_splits(
            batch, NUM_KV_HEADS, table.shape[1] * block_size, cfg.tile, sm_count(setup.q.device),
            split_programs_per_sm=TUNED.get("split_programs_per_sm"), min_tiles_per_split=TUNED.get("min_tiles_per_split"))
    workspace = torch.empty(decode_workspace_numel(batch, NUM_HEADS, HEAD_DIM, num_splits), device=setup.q.device)

    def make_call(q, p):
        out = torch.empty_like(q)
        return lambda: paged_decode_attention(q, *p, out=out, workspace=workspace, num_splits=num_splits, config=cfg)

    call = make_call(setup.q, paged)
    err = rel_err(call(), setup.expected)
    result = {"num_splits": num_splits, "tile": cfg.tile, "num_warps": cfg.num_warps,
              "num_stages": cfg.num_stages, "fused_merge": cfg.fused_merge, "rel_err": err}
    if per_call:
        result["time_us"] = time_us(call)
    if eager:
        result["eager_time_us"] = round(time_us(call, graph=False), 3)
    if steady:
        sets = sets or _rotation(setup, paged, decode_bytes(batch, setup.k.shape[2]), gen)
        t, k = steady_time_us([make_call(q, p) for q, p in sets], result.get("time_us"))
        result.update(steady_time_us=t, steady_calls=k, steady_sets=len(sets))
    return result


def time_prefill(setup: Contiguous, paged, config=None, steady: bool = True, per_call: bool = True,
                 gen=None) -> dict:
    from simkv.gpu.kernels import paged_prefill_attention, prefill_config

    batch, _, new_tokens, _ = setup.q.shape
    cfg = config or TUNED.get("prefill_config") or prefill_config(HEAD_DIM, DTYPE)
    starts = torch.arange(0, batch + 1, device=setup.q.device, dtype=torch.int32) * new_tokens

    def make_call(q4, p):
        q = q4.transpose(1, 2).reshape(batch * new_tokens, NUM_HEADS, HEAD_DIM)
        out = torch.empty_like(q)
        return lambda: paged_prefill_attention(q, p[0], p[1], p[2], starts, p[3], out=out, config=cfg)

    call = make_call(setup.q, paged)
    err = rel_err(call(), setup.expected)
    result = {"block_m": cfg.block_m, "block_n": cfg.block_n, "num_warps": cfg.num_warps,
              "num_stages": cfg.num_stages, "prefetch_pages": cfg.prefetch_pages, "rel_err": err}
    if per_call:
        result["time_us"] = time_us(call)
    if steady:
        cached = setup.k.shape[2] - new_tokens
        sets = _rotation(setup, paged, prefill_bytes(batch, new_tokens, cached), gen)
        t, k = steady_time_us([make_call(q, p) for q, p in sets], result.get("time_us"))
        result.update(steady_time_us=t, steady_calls=k, steady_sets=len(sets))
    return result


def _row(kernel, batch, context, block_size, time_us_, baseline_us, nbytes, **extra) -> dict:
    row = {
        "kernel": kernel, "batch": batch, "context": context, "block_size": block_size,
        "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
        "dtype": str(DTYPE).removeprefix("torch."),
        "time_us": round(time_us_, 3), "tbps": round(nbytes / time_us_ / 1e6, 4),
        "baseline": "sdpa_contiguous", "baseline_time_us": round(baseline_us, 3),
        "baseline_tbps": round(nbytes / baseline_us / 1e6, 4),
    }
    row.update(extra)
    return row


def _steady_columns(m: dict, baseline: tuple | None, nbytes: float) -> dict:
    """The steady-state columns of a row from a measurement and the baseline's steady time."""
    cols = {}
    if "steady_time_us" in m:
        t = m.pop("steady_time_us")
        cols.update(steady_time_us=round(t, 3), steady_tbps=round(nbytes / t / 1e6, 4),
                    steady_calls=m.pop("steady_calls"), steady_sets=m.pop("steady_sets"))
    if baseline is not None:
        cols.update(baseline_steady_time_us=round(baseline[0], 3),
                    baseline_steady_tbps=round(nbytes / baseline[0] / 1e6, 4))
    return cols


class Budget:
    """Wall-clock budget of a run: `left()` seconds remain (inf without a limit)."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()


def _errored(kind: str, what, e: Exception) -> dict:
    msg = " ".join(str(e).split())[:200]
    print(f"  {kind} {what} failed: {type(e).__name__}: {msg}", file=sys.stderr, flush=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"error": f"{type(e).__name__}: {msg}"}


def bench_decode_point(batch, context, block_sizes, device, gen, steady: bool = True) -> list[dict]:
    """Rows of one (batch, context) decode point, one per block size; a failure is recorded in an
    `error` column rather than raised."""
    rows = []
    nbytes = decode_bytes(batch, context)
    setup = decode_setup(batch, context, device)
    base = None
    if steady:
        try:
            base = baseline_steady(setup, nbytes)
        except Exception as e:  # noqa: BLE001 - keep the run going
            _errored("sdpa steady", (batch, context), e)
    for block_size in block_sizes:
        try:
            paged = paged_copy(setup.k, setup.v, block_size, gen)
            m = time_decode(setup, paged, eager=block_size == 16, steady=steady, gen=gen)
            del paged
            t = m.pop("time_us")
            rows.append(_row("paged_decode", batch, context, block_size, t, setup.baseline_us, nbytes,
                             baseline_variant=setup.baseline_variant, **_steady_columns(m, base, nbytes), **m))
            _print_progress(rows[-1])
        except Exception as e:  # noqa: BLE001
            rows.append({"kernel": "paged_decode", "batch": batch, "context": context, "block_size": block_size,
                         **_errored("decode", (batch, context, block_size), e)})
    del setup
    torch.cuda.empty_cache()
    return rows


def bench_prefill_point(point, block_sizes, device, gen, steady: bool = True) -> list[dict]:
    batch, new_tokens, cached_tokens = point
    rows = []
    setup = prefill_setup(batch, new_tokens, cached_tokens, device)
    nbytes = prefill_bytes(batch, new_tokens, cached_tokens)
    flops = prefill_flops(batch, new_tokens, cached_tokens)
    base = None
    if steady:
        try:
            base = baseline_steady(setup, nbytes)
        except Exception as e:  # noqa: BLE001
            _errored("sdpa steady", point, e)
    for block_size in block_sizes:
        try:
            m = time_prefill(setup, paged_copy(setup.k, setup.v, block_size, gen), steady=steady, gen=gen)
            t = m.pop("time_us")
            extra = {}
            if "steady_time_us" in m:
                extra["steady_tflops"] = round(flops / m["steady_time_us"] / 1e6, 2)
            if base is not None:
                extra["baseline_steady_tflops"] = round(flops / base[0] / 1e6, 2)
            rows.append(_row(
                "paged_prefill", batch, new_tokens + cached_tokens, block_size, t, setup.baseline_us, nbytes,
                baseline_variant=setup.baseline_variant, new_tokens=new_tokens, cached_tokens=cached_tokens,
                tflops=round(flops / t / 1e6, 2), baseline_tflops=round(flops / setup.baseline_us / 1e6, 2),
                **_steady_columns(m, base, nbytes), **extra, **m,
            ))
            _print_progress(rows[-1])
        except Exception as e:  # noqa: BLE001
            rows.append({"kernel": "paged_prefill", "batch": batch, "context": new_tokens + cached_tokens,
                         "block_size": block_size, "new_tokens": new_tokens, "cached_tokens": cached_tokens,
                         **_errored("prefill", (point, block_size), e)})
    del setup
    torch.cuda.empty_cache()
    return rows


def _print_progress(row: dict) -> None:
    steady = ""
    if "steady_time_us" in row:
        steady = f" | steady {row['steady_time_us']:8.1f} us"
        if "baseline_steady_time_us" in row:
            steady += f" vs sdpa {row['baseline_steady_time_us']:8.1f} us"
    print(f"  {row['kernel']:13s} b={row['batch']:<4d} ctx={row['context']:<6d} bs={row['block_size']:<4d} "
          f"{row['time_us']:9.1f} us {row['tbps']:6.3f} TB/s | sdpa {row['baseline_time_us']:9.1f} us "
          f"{row['baseline_tbps']:6.3f} TB/s{steady} | err {row['rel_err']:.1e}", flush=True)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return dict(value.__dict__) if hasattr(value, "__dict__") else value


def metadata(command: str, notes: dict | None = None) -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = None
    meta = {
        "gpu": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "gpu_memory_bytes": props.total_memory,
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "shapes": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                   "dtype": str(DTYPE).removeprefix("torch."), "block_table": "random permutation of the blocks"},
        "timing": "time_us: one call captured in a CUDA graph, replays timed by triton.testing.do_bench (median, "
                  "CUDA events, L2 flushed before each call, warmup 10 ms, rep 50 ms); same for the baseline; "
                  "eager_time_us (block 16 rows): the decode call timed without a graph (adds Python/launch "
                  "overhead)",
        "steady_timing": f"steady_time_us: steady_calls (<= {STEADY_CALLS}) calls back to back in one CUDA graph, "
                         f"cycling over steady_sets input sets (own q, KV, block table, out) spanning >= "
                         f"{STEADY_MIN_BYTES / 1e6:.0f} MB of KV+q+out (at most {STEADY_MAX_SETS} sets); median "
                         "replay time (CUDA events) / steady_calls; baseline_steady_*: the same for SDPA",
        "launch_overrides": _jsonable(TUNED) or "none: the kernels' defaults (per-row tile/warps/stages/splits)",
        "bytes": "K and V read once + q read + out written (tbps = bytes / time)",
        "prefill_flops": "4 * head_dim * num_heads * attended (query, key) pairs under the causal mask",
        "baseline": "torch SDPA on contiguous [batch, kv_heads, context, head_dim] K/V, fastest variant "
                    "(baseline_variant), same run",
    }
    meta.update(notes or {})
    return meta


def print_table(df) -> None:
    """The target points: decode TB/s per block size against SDPA, and prefill TFLOP/s."""
    ok = df[df["time_us"].notna()] if "time_us" in df else df
    dec = ok[ok.kernel == "paged_decode"]
    print("\npaged_decode TB/s (per call) by block size; sdpa = contiguous baseline; steady = back to back")
    for (batch, context), g in dec.groupby(["batch", "context"]):
        if context != 4096 and not (batch in (1, 64, 128) and context in (2048, 16384)):
            continue
        cells = " ".join(f"{int(r.block_size)}:{r.tbps:.2f}" for r in g.itertuples())
        r0 = g.iloc[0]
        bs16 = g[g.block_size == 16]
        ours16 = f"{bs16.time_us.iloc[0]:.1f} us" if len(bs16) else "-"
        steady = ""
        if len(bs16) and "steady_time_us" in g and "baseline_steady_time_us" in g:
            s = bs16.iloc[0]
            steady = (f" | steady bs16 {s.steady_time_us:7.1f} us vs sdpa {s.baseline_steady_time_us:7.1f} us "
                      f"(x{s.baseline_steady_time_us / s.steady_time_us:.2f})")
        print(f"  b={batch:<4d} ctx={context:<6d} sdpa {r0.baseline_tbps:.2f} TB/s {r0.baseline_time_us:8.1f} us | "
              f"bs16 {ours16:>11s} | {cells}{steady}")
    pre = ok[ok.kernel == "paged_prefill"]
    if len(pre):
        print("\npaged_prefill TFLOP/s, ours vs SDPA causal (per call; steady in brackets)")
        for r in pre.itertuples():
            steady = ""
            if "steady_tflops" in pre and "baseline_steady_tflops" in pre:
                steady = f" [{r.steady_tflops:7.1f} vs {r.baseline_steady_tflops:7.1f}]"
            print(f"  b={r.batch:<3d} new={int(r.new_tokens):<5d} cached={int(r.cached_tokens):<5d} bs={r.block_size:<4d} "
                  f"{r.tflops:7.1f} vs {r.baseline_tflops:7.1f} ({r.baseline_variant}) ratio "
                  f"{r.baseline_time_us / r.time_us:.2f}{steady}")


def tidy(df):
    """Required columns first; integer extras stay integers where decode and prefill rows mix."""
    for c in COLUMNS:
        if c not in df:
            df[c] = None
    df = df[COLUMNS + [c for c in df.columns if c not in COLUMNS]].copy()
    for c in ("num_splits", "tile", "num_warps", "num_stages", "new_tokens", "cached_tokens", "block_m", "block_n",
              "steady_calls", "steady_sets"):
        if c in df:
            df[c] = df[c].astype("Int64")
    return df.sort_values(["kernel", "context", "batch", "block_size"], kind="stable").reset_index(drop=True)


def _work_order(decode_points, prefill_points):
    """Target points first (a time budget never drops them), then the rest in grid order."""
    first_d = [p for p in TARGET_DECODE if p in decode_points]
    first_p = [p for p in TARGET_PREFILL if p in prefill_points]
    work = [("decode", p) for p in first_d] + [("prefill", p) for p in first_p]
    work += [("decode", p) for p in decode_points if p not in first_d]
    work += [("prefill", p) for p in prefill_points if p not in first_p]
    return work


def run_kernel_bench(out_path=DEFAULT_OUT, quick: bool = False, command: str | None = None,
                     block_sizes=None, time_budget_s: float | None = None, steady: bool = True):
    """Measure the paged kernels on the current CUDA GPU; write the CSV and a metadata JSON beside it.

    Returns the rows as a pandas DataFrame. `quick` measures only the target points;
    `block_sizes` limits the block sizes; with `time_budget_s`, points (targets first) start
    only while the budget lasts, and the ones left out are listed in the metadata.
    """
    import pandas as pd

    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    torch.manual_seed(0)
    batches, contexts, points = (QUICK_BATCHES, QUICK_CONTEXTS, QUICK_PREFILL_POINTS) if quick else (
        BATCHES, CONTEXTS, PREFILL_POINTS)
    block_sizes = tuple(block_sizes or BLOCK_SIZES)
    decode_points = [(b, c) for c in contexts for b in batches if decode_bytes(b, c) <= MAX_KV_BYTES]
    budget = Budget(time_budget_s)
    rows, skipped = [], []
    for kind, point in _work_order(decode_points, list(points)):
        if budget.left() <= 0:
            skipped.append([kind, *point])
            continue
        try:
            if kind == "decode":
                rows += bench_decode_point(*point, block_sizes, device, gen, steady=steady)
            else:
                rows += bench_prefill_point(point, block_sizes, device, gen, steady=steady)
        except Exception as e:  # noqa: BLE001 - e.g. the SDPA setup ran out of memory
            rows.append({"kernel": "paged_" + kind, "batch": point[0], "context": sum(point[1:]),
                         **_errored(kind, point, e)})
    df = tidy(pd.DataFrame(rows))
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out_path, index=False)
    command = command or "python -m simkv.gpu.bench kernels --out " + str(out_path) + (" --quick" if quick else "")
    notes = {"block_sizes": list(block_sizes)}
    if skipped:
        notes["not_measured_time_budget"] = skipped
    out_path.with_suffix(".json").write_text(json.dumps(metadata(command, notes), indent=2) + "\n")
    print_table(df)
    if skipped:
        print(f"\nleft out for the time budget: {skipped}")
    return df


# -- tune ----------------------------------------------------------------------------------------
# (split programs per SM, min tiles per split) candidates of the decode split rule
TUNE_SPLIT_POLICIES = ((1, 2), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1))
TUNE_DECODE_POINTS = ((1, 4096), (4, 4096), (8, 4096), (1, 16384), (4, 16384), (8, 16384))
TUNE_DECODE_CONFIGS = ((32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 3), (128, 4, 2))
TUNE_PREFILL_POINTS = ((8, 2048, 0), (8, 512, 2048))
TUNE_CONFIG_POINT = (64, 4096)   # decode kernel configuration per block size (unsplit there)
PREFILL_MAX_REL_ERR = 0.02   # bf16 against SDPA; a config above it is wrong, not slow


def prefill_tune_grid() -> list[tuple]:
    """(block_m, block_n, num_warps, num_stages), the current default and earlier front-runners
    first, so that a time budget that ends the sweep early still compares them."""
    first = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3)]
    grid = [(m, n, w, s) for m in (128, 64) for n in (64, 128, 32) for w in (8, 4) for s in (3, 2, 4)]
    return first + [c for c in grid if c not in first]


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("inf")


def run_tune(out_dir, quick: bool = False, time_budget_s: float | None = None, device="cuda") -> dict:
    """Sweep launch parameters; write every measurement to `<out_dir>/tune.csv` and the choices
    to `<out_dir>/best.json` (the `kernels --configs` format plus the constants to set in the
    code); return the choices. `quick`: decode split policy and merge at batch 1/4/8 × 4096 and
    16384, and the prefill sweep at 8 × 2048 only. Each stage starts only while `time_budget_s`
    lasts (the prefill sweep checks it before every configuration); failures are recorded."""
    import dataclasses

    import pandas as pd

    from simkv.gpu.kernels import DecodeConfig, PrefillConfig, decode_config, decode_num_splits, prefill_config
    from simkv.gpu.kernels._common import sm_count

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(1)
    torch.manual_seed(1)
    budget = Budget(time_budget_s)
    sms = sm_count(device)
    rows, notes = [], []

    def record(stage, point, m, baseline_us=None, **extra):
        row = {"stage": stage, "point": "x".join(map(str, point)), **extra, **m}
        if baseline_us is not None and "steady_time_us" in m:
            row["sdpa_steady_us"] = round(baseline_us, 3)
            row["vs_sdpa_steady"] = round(baseline_us / m["steady_time_us"], 3)
        rows.append(row)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k not in ("stage", "point")}
        print(f"  {stage} {row['point']} {shown}", flush=True)
        return row

    # 1. decode: split rule and merge (fused or a second kernel) at small batches, block 16
    base_cfg = TUNED.get("decode_configs", {}).get(16) or decode_config(16, HEAD_DIM, DTYPE)
    times = {}   # (point, splits, fused) -> steady µs
    splits_of = {}   # (point, policy) -> splits
    sdpa_steady = {}
    for batch, context in TUNE_DECODE_POINTS:
        if budget.left() <= 0:
            notes.append(f"decode point {batch}x{context} not measured (time budget)")
            continue
        point = (batch, context)
        try:
            setup = decode_setup(batch, context, device)
            nbytes = decode_bytes(batch, context)
            sdpa_steady[point] = baseline_steady(setup, nbytes)[0]
            paged = paged_copy(setup.k, setup.v, 16, gen)
            sets = _rotation(setup, paged, nbytes, gen)
        except Exception as e:  # noqa: BLE001
            notes.append(f"decode point {point}: {_errored('decode setup', point, e)['error']}")
            continue
        for policy in TUNE_SPLIT_POLICIES:
            splits_of[(point, policy)] = decode_num_splits(batch, NUM_KV_HEADS, context, base_cfg.tile, sms,
                                                           split_programs_per_sm=policy[0],
                                                           min_tiles_per_split=policy[1])
        for fused in (True, False):
            cfg = dataclasses.replace(base_cfg, fused_merge=fused)
            for splits in sorted({s for (p, _), s in splits_of.items() if p == point}):
                try:
                    m = time_decode(setup, paged, cfg, splits, sets=sets)
                except Exception as e:  # noqa: BLE001
                    record("decode_splits", point, _errored("decode", (point, splits, fused), e),
                           num_splits=splits, fused_merge=fused)
                    continue
                if m["rel_err"] > PREFILL_MAX_REL_ERR:
                    notes.append(f"decode {point} splits {splits} fused {fused}: rel_err {m['rel_err']:.3g}")
                    continue
                times[(point, splits, fused)] = m["steady_time_us"]
                record("decode_splits", point, m, sdpa_steady[point], block_size=16)
        del setup, paged, sets
        torch.cuda.empty_cache()

    scores = {}
    points_done = sorted(sdpa_steady)
    for policy in TUNE_SPLIT_POLICIES:
        for fused in (True, False):
            ratios = [times.get((p, splits_of[(p, policy)], fused)) for p in points_done]
            if points_done and all(r is not None for r in ratios):
                scores[(policy, fused)] = _geomean(t / sdpa_steady[p] for t, p in zip(ratios, points_done))
    best_policy, best_fused = min(scores, key=scores.get) if scores else (
        (None, None), base_cfg.fused_merge)

    # 2. decode kernel configuration per block size at batch 64 × 4096 (unsplit there); not quick
    best_decode = {}
    if not quick and budget.left() > 0:
        batch, context = TUNE_CONFIG_POINT
        try:
            setup = decode_setup(batch, context, device)
            for block_size in BLOCK_SIZES:
                if budget.left() <= 0:
                    break
                paged = paged_copy(setup.k, setup.v, block_size, gen)
                sets = _rotation(setup, paged, decode_bytes(batch, context), gen)
                cfg_times = {}
                for c in TUNE_DECODE_CONFIGS:
                    cfg = DecodeConfig(*c, fused_merge=best_fused)
                    try:
                        m = time_decode(setup, paged, cfg, sets=sets)
                    except Exception as e:  # noqa: BLE001
                        record("decode_config", (batch, context, block_size), _errored("decode", cfg, e))
                        continue
                    cfg_times[cfg] = m["steady_time_us"]
                    record("decode_config", (batch, context, block_size), m, block_size=block_size)
                if cfg_times:
                    best_decode[block_size] = min(cfg_times, key=cfg_times.get)
                del paged, sets
            del setup
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            notes.append(f"decode config sweep: {_errored('decode config sweep', '', e)['error']}")
    for block_size in BLOCK_SIZES:
        cfg = best_decode.get(block_size) or TUNED.get("decode_configs", {}).get(block_size) or decode_config(
            block_size, HEAD_DIM, DTYPE)
        best_decode[block_size] = dataclasses.replace(cfg, fused_merge=best_fused)

    # 3. prefill tiles at 8 × 2048 new tokens (and 8 × 512 over 2048 cached unless quick), block 16
    pcost = {}   # PrefillConfig -> {point: µs}
    prefill_points = TUNE_PREFILL_POINTS[:1] if quick else TUNE_PREFILL_POINTS
    sdpa_prefill = {}
    for point in prefill_points:
        if budget.left() <= 0:
            notes.append(f"prefill point {point} not measured (time budget)")
            continue
        try:
            setup = prefill_setup(*point, device)
            paged = paged_copy(setup.k, setup.v, 16, gen)
        except Exception as e:  # noqa: BLE001
            notes.append(f"prefill point {point}: {_errored('prefill setup', point, e)['error']}")
            continue
        sdpa_prefill[point] = setup.baseline_us
        flops = prefill_flops(*point)

        def measure(cfg):
            try:
                m = time_prefill(setup, paged, cfg, steady=False)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                record("prefill_config", point, _errored("prefill", cfg, e), **dataclasses.asdict(cfg))
                return
            if m["rel_err"] > PREFILL_MAX_REL_ERR:
                notes.append(f"prefill {point} {cfg}: rel_err {m['rel_err']:.3g}")
                return
            pcost.setdefault(cfg, {})[point] = m["time_us"]
            record("prefill_config", point, m, block_size=16, tflops=round(flops / m["time_us"] / 1e6, 1),
                   sdpa_tflops=round(flops / setup.baseline_us / 1e6, 1), vs_sdpa=round(setup.baseline_us / m["time_us"], 3))

        if point == prefill_points[0]:
            # the front-runners with both ways of loading the block table, then the rest of the
            # grid, then the other way for the fastest of the grid not yet tried both ways
            grid = [PrefillConfig(*c) for c in prefill_tune_grid()]
            grid = grid[:3] + [dataclasses.replace(c, prefetch_pages=not c.prefetch_pages) for c in grid[:3]] + grid[3:]
            for cfg in grid:
                if budget.left() <= 0:
                    notes.append(f"prefill sweep stopped by the time budget before {cfg}")
                    break
                measure(cfg)
            ranked = sorted((c for c in pcost if point in pcost[c]), key=lambda c: pcost[c][point])[:3]
            for cfg in ranked:
                twin = dataclasses.replace(cfg, prefetch_pages=not cfg.prefetch_pages)
                if twin in pcost or budget.left() <= 0:
                    continue
                measure(twin)
        else:  # the front-runners only
            ranked = sorted(pcost, key=lambda c: pcost[c].get(prefill_points[0], float("inf")))[:4]
            for cfg in ranked:
                if budget.left() <= 0:
                    break
                measure(cfg)
        del setup, paged
        torch.cuda.empty_cache()

    def prefill_score(cfg):
        got = pcost[cfg]
        if any(p not in got for p in sdpa_prefill):
            return float("inf")
        return _geomean(got[p] / sdpa_prefill[p] for p in sdpa_prefill)

    default_prefill = prefill_config(HEAD_DIM, DTYPE)
    best_prefill = min(pcost, key=prefill_score) if pcost else default_prefill

    target = TUNE_PREFILL_POINTS[0]
    evidence = {
        "decode_policy_scores (geomean steady time / SDPA steady over the points)": {
            f"per_sm={p[0]} min_tiles={p[1]} fused={f}": round(v, 4) for (p, f), v in sorted(scores.items(), key=lambda x: x[1])},
        "decode_points_measured": [f"{b}x{c}" for b, c in points_done],
        "prefill_at_8x2048": {
            "sdpa_us": round(sdpa_prefill[target], 2) if target in sdpa_prefill else None,
            "best_us": round(pcost[best_prefill][target], 2) if best_prefill in pcost and target in pcost[best_prefill] else None,
            "default_us": round(pcost[default_prefill][target], 2) if default_prefill in pcost and target in pcost[default_prefill] else None,
        },
        "notes": notes,
    }
    best = {
        # `kernels --configs` reads these
        "decode_configs": {str(b): dataclasses.asdict(c) for b, c in best_decode.items()},
        "split_programs_per_sm": best_policy[0],
        "min_tiles_per_split": best_policy[1],
        "prefill_config": dataclasses.asdict(best_prefill),
        # what to set in the code
        "constants": {
            "simkv/gpu/launch_policy.py": {"SPLIT_PROGRAMS_PER_SM": best_policy[0],
                                           "MIN_TILES_PER_SPLIT": best_policy[1]},
            "simkv/gpu/kernels/decode.py": {"DecodeConfig.fused_merge": best_fused,
                                            "decode_config (bf16, head_dim<=128), per block size":
                                                {str(b): [c.tile, c.num_warps, c.num_stages] for b, c in best_decode.items()}},
            "simkv/gpu/kernels/prefill.py": {"PrefillConfig defaults (bf16/fp16, head_dim<=128)":
                                             dataclasses.asdict(best_prefill)},
        },
        "evidence": evidence,
        "quick": quick,
    }
    pd.DataFrame(rows).to_csv(out_dir / "tune.csv", index=False)
    (out_dir / "best.json").write_text(json.dumps(best, indent=2) + "\n")
    _print_tune_summary(scores, splits_of, points_done, times, sdpa_steady, pcost, sdpa_prefill, best)
    return best


def _print_tune_summary(scores, splits_of, points, times, sdpa_steady, pcost, sdpa_prefill, best) -> None:
    print("\ndecode split policy (steady µs per point; geomean ratio to SDPA steady)")
    header = " ".join(f"{b}x{c:<6d}" for b, c in points)
    print(f"  {'per_sm,min_tiles,fused':24s} {header}  score")
    for (policy, fused), score in sorted(scores.items(), key=lambda x: x[1]):
        cells = " ".join(f"{times[(p, splits_of[(p, policy)], fused)]:8.1f}" for p in points)
        print(f"  {str(policy) + ' ' + str(fused):24s} {cells}  {score:.3f}")
    print(f"  {'sdpa':24s} " + " ".join(f"{sdpa_steady[p]:8.1f}" for p in points))
    if pcost:
        print("\nprefill configurations, fastest first (µs per call; SDPA " +
              ", ".join(f"{'x'.join(map(str, p))}: {t:.1f}" for p, t in sdpa_prefill.items()) + ")")
        first = next(iter(sdpa_prefill), None)
        ranked = sorted(pcost, key=lambda c: pcost[c].get(first, float("inf")))
        for cfg in ranked[:8]:
            cells = " ".join(f"{'x'.join(map(str, p))}: {t:8.1f}" for p, t in pcost[cfg].items())
            print(f"  m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
                  f"prefetch={cfg.prefetch_pages!s:5s} {cells}")
    print("\nbest:", json.dumps({k: best[k] for k in ("decode_configs", "split_programs_per_sm",
                                                      "min_tiles_per_split", "prefill_config")}))


def load_tuned(path) -> None:
    """Use the launch parameters of a `tune` result (its best.json) in this process's measurements."""
    from simkv.gpu.kernels import DecodeConfig, PrefillConfig

    def make(cls, value):
        return cls(**value) if isinstance(value, dict) else cls(*value)

    best = json.loads(Path(path).read_text())
    TUNED.clear()
    TUNED["decode_configs"] = {int(b): make(DecodeConfig, c) for b, c in best["decode_configs"].items()}
    TUNED["prefill_config"] = make(PrefillConfig, best["prefill_config"])
    TUNED["split_programs_per_sm"] = best.get("split_programs_per_sm")
    TUNED["min_tiles_per_split"] = best.get("min_tiles_per_split")


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simkv.gpu.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels", help="benchmark the paged kernels against SDPA; write CSV + JSON")
    k.add_argument("--out", default=DEFAULT_OUT)
    k.add_argument("--quick", action="store_true", help="only the target points")
    k.add_argument("--configs", help="launch parameters from `tune` (its best.json) instead of the defaults")
    k.add_argument("--block-sizes", type=_sizes, help="comma-separated block sizes (default: all)")
    k.add_argument("--time-budget-s", type=float, help="start no new point after this many seconds "
                   "(target points run first)")
    k.add_argument("--no-steady", action="store_true", help="per-call timing only")
    t = sub.add_parser("tune", help="sweep launch parameters at the target points")
    t.add_argument("--out", default="kernel_tune", help="directory for tune.csv and best.json")
    t.add_argument("--quick", action="store_true", help="decode split policy at batch 1/4/8 and the prefill "
                   "sweep at 8 x 2048 only; budget 170 s unless --time-budget-s")
    t.add_argument("--time-budget-s", type=float, help="start no new measurement after this many seconds")
    t.add_argument("--configs", help="start from the launch parameters of an earlier best.json")
    args = parser.parse_args(argv)
    command = "python -m simkv.gpu.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.configs:
        load_tuned(args.configs)
    if args.what == "kernels":
        run_kernel_bench(args.out, quick=args.quick, command=command, block_sizes=args.block_sizes,
                         time_budget_s=args.time_budget_s, steady=not args.no_steady)
    else:
        budget = args.time_budget_s if args.time_budget_s is not None else (170.0 if args.quick else None)
        run_tune(args.out, quick=args.quick, time_budget_s=budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
