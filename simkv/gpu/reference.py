"""Plain torch reference implementations of the paged-cache kernels (same signatures).

Each sequence's blocks are gathered into a contiguous [context, num_kv_heads, head_dim] tensor and
attention is computed with an explicit softmax, in float32 (float64 when q is float64). Slow and
obviously correct: the kernels are tested against these, and the engine's CPU path runs them.
"""

from __future__ import annotations

import math

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
                   first_block: int = 0) -> torch.Tensor:
    """Tokens first_block × block_size .. context_len - 1 of one sequence's K or V:
    [tokens, num_kv_heads, head_dim] (the blocks before `first_block` are not read)."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = cache[block_table[first_block:num_blocks].long()]  # [blocks, block_size, heads, dim]
    return blocks.reshape(-1, *cache.shape[2:])[:context_len - first_block * block_size]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float,
            window: int | None = None, first_key: int = 0) -> torch.Tensor:
    """q [n, heads, dim] at `positions` over k, v [keys, kv_heads, dim] of positions first_key
    on; causal by position, and with a sliding `window` a query at p sees keys p - window + 1 ..
    p only."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    keys = first_key + torch.arange(k.shape[0], device=q.device)
    visible = keys[None, :] <= positions[:, None]  # [n, context]
    if window is not None:
        visible &= keys[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None, out=None, window=None):
    """Reference decode: out[s] = softmax(q[s] · K_s / √d) V_s over the first seq_lens[s] tokens
    (the last `window` of them with a sliding window); a row with seq_lens[s] == 0 is padding and
    is left untouched (into `out` if given)."""
    dtype = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    for s in range(q.shape[0]):
        context = int(seq_lens[s])
        if context == 0:
            continue
        # blocks wholly before the window are not read (a KV manager may have freed them)
        first = 0 if window is None else max(0, context - window) // k_cache.shape[1]
        k = gather_context(k_cache, block_tables[s], context, first).to(dtype)
        v = gather_context(v_cache, block_tables[s], context, first).to(dtype)
        position = torch.tensor([context - 1], device=q.device)
        out[s] = _attend(q[s : s + 1].to(dtype), k, v, position, scale, window,
                         first * k_cache.shape[1])[0].to(q.dtype)
    return out


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale=None,
                            out=None, window=None):
    """Reference prefill: causal attention of each sequence's new tokens over its whole context
    (a token at p over p - window + 1 .. p with a sliding window); rows outside the sequences'
    query ranges are left untouched (into `out` if given)."""
    dtype = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    for s in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        if end == start:
            continue
        context = int(seq_lens[s])
        first_pos = context - (end - start)
        first = 0 if window is None else max(0, first_pos - window + 1) // k_cache.shape[1]
        k = gather_context(k_cache, block_tables[s], context, first).to(dtype)
        v = gather_context(v_cache, block_tables[s], context, first).to(dtype)
        positions = torch.arange(first_pos, context, device=q.device)
        out[start:end] = _attend(q[start:end].to(dtype), k, v, positions, scale, window,
                                 first * k_cache.shape[1]).to(q.dtype)
    return out


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping):
    """Reference write: cache[slot // block_size, slot % block_size] = token; negative slots skipped."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots // block_size, slots % block_size] = key[keep].to(k_cache.dtype)
    v_cache[slots // block_size, slots % block_size] = value[keep].to(v_cache.dtype)


def copy_blocks(k_cache, v_cache, block_mapping):
    """Reference block copy: cache[dst] = cache[src] for each (src, dst) row."""
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]
