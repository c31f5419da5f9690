"""One kernel benchmark point: its inputs, the SDPA baseline, and the paged kernels measured on them.

Shapes: 32 query heads, 8 KV heads, head_dim 128, bfloat16. A point's contiguous q/K/V
(`Contiguous`, from `decode_setup` / `prefill_setup`) carry the fastest torch SDPA variant over
them, its time and its output; `paged_copy` scatters the K/V into a paged cache through a shuffled
block table. `time_decode` / `time_prefill` check the paged kernel against SDPA's output and time
it per call and in steady state (`kernel_timing`), with the launch parameters of `TUNED` (a `tune`
result, read by `load_tuned`) or the kernels' defaults. `Budget` and `errored` let a run of many
points keep to a time limit and go on past a failed one.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from simkv.gpu.kernel_timing import steady_sets, steady_time_us, time_us

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BLOCK_SIZES = (8, 16, 32, 64, 128)
# Launch-parameter overrides from `tune` (--configs); empty: the kernels' own defaults.
TUNED: dict = {}


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
            t = time_us(lambda kv=kv: call(q, kv))   # bound now: kv is deleted below
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


def rotation(setup: Contiguous, paged, nbytes: float, gen) -> list:
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
        sets = sets or rotation(setup, paged, decode_bytes(batch, setup.k.shape[2]), gen)
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
        sets = rotation(setup, paged, prefill_bytes(batch, new_tokens, cached), gen)
        t, k = steady_time_us([make_call(q, p) for q, p in sets], result.get("time_us"))
        result.update(steady_time_us=t, steady_calls=k, steady_sets=len(sets))
    return result


class Budget:
    """Wall-clock budget of a run: `left()` seconds remain (inf without a limit)."""

    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.monotonic()


def errored(kind: str, what, e: Exception) -> dict:
    msg = " ".join(str(e).split())[:200]
    print(f"  {kind} {what} failed: {type(e).__name__}: {msg}", file=sys.stderr, flush=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"error": f"{type(e).__name__}: {msg}"}


# -- sliding-window decode: time against full context, and the pages each launch reads -------


def random_paged(batch: int, context: int, block_size: int, device, gen: torch.Generator):
    """Random paged K/V of `batch` sequences of `context` tokens made in place (no contiguous
    copy, so that 32k contexts at batch 64 fit), a shuffled block table, and a q."""
    per_seq = -(-context // block_size)
    shape = (batch * per_seq, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=device, dtype=DTYPE, generator=gen)
    v_cache = torch.randn(shape, device=device, dtype=DTYPE, generator=gen)
    table = torch.randperm(batch * per_seq, device=device, generator=gen).view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=DTYPE, generator=gen)
    return q, (k_cache, v_cache, table, seq_lens)


def window_kv_bytes(batch: int, context: int, window: int | None) -> int:
    """K and V bytes of the tokens the queries attend to (the whole context without a window)."""
    tokens = context if window is None else min(window, context)
    return 2 * batch * tokens * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize


def measure_window_decode(q, paged, window: int | None, check_seqs: int = 2) -> dict:
    """One decode launch with `window` (None: full context): its rel_err against the torch
    reference on the first `check_seqs` sequences, the K/V tokens and pages it reads (the
    kernel's own count, K and V) in bytes, and its time per call (CUDA graph, `time_us`)."""
    from simkv.gpu import reference
    from simkv.gpu.kernels import paged_decode_attention

    k_cache, v_cache, table, seq_lens = paged
    batch, block_size = q.shape[0], k_cache.shape[1]
    counts = torch.zeros(batch, 2, dtype=torch.int32, device=q.device)
    out = torch.empty_like(q)
    paged_decode_attention(q, *paged, out=out, window=window, load_counts=counts)
    n = min(check_seqs, batch)
    ref = reference.paged_decode_attention(q[:n], k_cache, v_cache, table[:n], seq_lens[:n], window=window)
    tokens, pages = (int(v) for v in counts.sum(0).tolist())
    head_token_bytes = HEAD_DIM * DTYPE.itemsize     # one token of one KV head, K or V
    call = lambda: paged_decode_attention(q, *paged, out=out, window=window)  # noqa: E731
    return {"rel_err": rel_err(out[:n], ref), "kv_bytes_loaded": 2 * tokens * head_token_bytes,
            "block_bytes_loaded": 2 * pages * block_size * head_token_bytes, "blocks_loaded": pages,
            "time_us": time_us(call)}


def measure_window_prefill(batch: int, new_tokens: int, cached_tokens: int, block_size: int,
                           window: int | None, device, gen) -> dict:
    """One prefill launch of `new_tokens` per sequence over `cached_tokens` with `window`:
    rel_err against the reference on the first sequence and the time per call."""
    from simkv.gpu import reference
    from simkv.gpu.kernels import paged_prefill_attention

    context = new_tokens + cached_tokens
    _, paged = random_paged(batch, context, block_size, device, gen)
    k_cache, v_cache, table, seq_lens = paged
    q = torch.randn(batch * new_tokens, NUM_HEADS, HEAD_DIM, device=device, dtype=DTYPE, generator=gen)
    starts = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * new_tokens
    out = torch.empty_like(q)
    call = lambda: paged_prefill_attention(q, k_cache, v_cache, table, starts, seq_lens, out=out,  # noqa: E731
                                           window=window)
    call()
    ref = reference.paged_prefill_attention(q[:new_tokens], k_cache, v_cache, table[:1], starts[:2], seq_lens[:1],
                                            window=window)
    return {"rel_err": rel_err(out[:new_tokens], ref), "time_us": time_us(call)}
