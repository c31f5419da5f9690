"""Paged decode attention: split-K flash-decoding over a paged KV cache, merged in-kernel.

One program handles one (KV head, split, sequence): every query head that shares the KV head
(GQA group, padded to 16 rows so that `tl.dot` uses tensor cores) against a contiguous range of
the sequence's tokens. Each loop iteration streams a TILE of tokens that may span several pages,
gathering page numbers from the block table one tile ahead. With one split the program writes
the output directly. With more, each program writes its partial result (unnormalised
accumulator, running max, running sum) to a float32 workspace and then counts itself done on an
int32 counter of its (sequence, KV head); the program that finishes last merges the splits of
that group of heads, writes the output and sets the counter back to 0, so that the counters are
zero between calls and a call can be replayed from a CUDA graph. (`DecodeConfig.fused_merge`
False instead merges in a second kernel, one program per (query head, sequence).)

The grid depends only on shapes (num_seqs, num_kv_heads, max_blocks_per_seq) and the device's
SM count, never on tensor values, so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from simkv.launch_policy import decode_num_splits

from ._common import DOT_PRECISION, LOG2E, check_kv_cache, check_query, default_scale, next_pow2, offsets_fit_int32, sm_count


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel: tokens per loop iteration, warps, pipeline depth,
    and whether split results are merged by the last split program (True) or a second kernel."""

    tile: int = 64
    num_warps: int = 4
    num_stages: int = 2
    fused_merge: bool = False


def decode_config(block_size: int, head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """Launch configuration for a cache layout.

    bf16/fp16 with head_dim <= 128: tile 64, 4 warps, 2 stages, the fastest of a sweep on an H200
    at batch 64 × 4096 (profiles/h200/kernels.json) and within 1% across block sizes 8-128 there.
    fp32 and head_dim 256: chosen from the compiler's register report (no spills), not timed.
    """
    if dtype == torch.float32:  # IEEE fp32 dots run on FMA units and need many registers
        return DecodeConfig(tile=32, num_warps=8, num_stages=2)
    if head_dim > 128:
        return DecodeConfig(tile=32, num_warps=8, num_stages=3)
    return DecodeConfig(tile=64, num_warps=4, num_stages=2)


def decode_workspace_numel(num_seqs: int, num_heads: int, head_dim: int, num_splits: int) -> int:
    """float32 elements of scratch that a decode call with `num_splits` > 1 needs."""
    return num_seqs * num_heads * num_splits * (head_dim + 2)


# Zeroed int32 counters for the in-kernel merge, per device. A buffer that is outgrown is kept
# alive: CUDA graphs captured with it still use it (the kernel leaves its counters at 0).
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_counters(device: torch.device | str, numel: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least `numel` counters shared by decode calls on `device`
    (calls on one stream run one after another, so they may share it); None while a CUDA graph
    is being captured and the buffer held is too small (nothing may be allocated then)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    held = _COUNTERS.setdefault(device, [])
    if held and held[-1].numel() >= numel:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    buf = torch.zeros(max(numel, 2 * held[-1].numel() if held else 1024), dtype=torch.int32, device=device)
    held.append(buf)
    return buf


@triton.jit
def _merge_group(
    workspace_ptr, out_ptr, seq, kv_head, seq_len,
    stride_o_seq, stride_o_head,
    num_seqs, num_heads, num_splits,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    # The splits of one (sequence, KV head): GROUP query heads × num_splits partial results.
    # Loads bypass L1 (.cg): the partials were written by other programs, on other SMs.
    offs_g = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    rows = num_seqs.to(tl.int64) * num_heads * num_splits
    first = (seq.to(tl.int64) * num_heads + heads) * num_splits          # [GROUP_P2]
    offs_s = tl.arange(0, SPLITS_PAD)
    m_all = tl.load(workspace_ptr + rows * HEAD_DIM + first[None, :] + offs_s[:, None],
                    mask=(offs_s[:, None] < num_splits) & g_mask[None, :], other=float("-inf"),
                    cache_modifier=".cg")
    m_max = tl.max(m_all, 0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # padding heads and empty rows: weight 0
    offs_c = tl.arange(0, CHUNK)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    l_sum = tl.zeros([GROUP_P2], tl.float32)
    for c in range(0, tl.cdiv(num_splits, CHUNK)):
        split = c * CHUNK + offs_c
        valid = (split[:, None] < num_splits) & g_mask[None, :]           # [CHUNK, GROUP_P2]
        row = first[None, :] + split[:, None]
        m_c = tl.load(workspace_ptr + rows * HEAD_DIM + row, mask=valid, other=float("-inf"), cache_modifier=".cg")
        l_c = tl.load(workspace_ptr + rows * (HEAD_DIM + 1) + row, mask=valid, other=0.0, cache_modifier=".cg")
        part = tl.load(workspace_ptr + row[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                       mask=valid[:, :, None], other=0.0, cache_modifier=".cg")
        w = tl.exp2(m_c - m_max[None, :])
        acc += tl.sum(part * w[:, :, None], 0)
        l_sum += tl.sum(l_c * w, 0)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & (seq_len > 0))


# Integer arguments equal to 1 would otherwise be specialised into Python constants.
@triton.jit(do_not_specialize=["num_seqs", "num_heads", "num_splits", "window"])
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, workspace_ptr, counters_ptr,
    scale_log2e,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_tok, stride_k_head,
    stride_v_block, stride_v_tok, stride_v_head,
    stride_bt_seq,
    stride_o_seq, stride_o_head,
    num_seqs, num_heads, num_splits, window, load_counts_ptr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    FUSED_MERGE: tl.constexpr, GROUP_P2: tl.constexpr, SPLITS_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr,
    OFF32: tl.constexpr, PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, COUNT_LOADS: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    # With a sliding window the query (position seq_len - 1) sees keys from seq_len - window on;
    # the tiles before the one holding that key are never visited, so their pages are not read.
    first_key = tl.maximum(seq_len - window, 0) if HAS_WINDOW else 0
    first_tile = first_key // TILE
    num_tiles = tl.cdiv(seq_len, TILE)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, num_splits)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP

    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=g_mask[:, None], other=0.0,
    )
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head = k_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head = v_ptr + kv_head.to(tl.int64) * stride_v_head

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # Page numbers of the next tile are loaded one iteration ahead, so that the K/V loads of a
    # tile depend on no load of the same iteration and the compiler can pipeline them.
    tok = tile_lo * TILE + offs_t
    page = tl.load(bt_row + tok // BLOCK_SIZE, mask=(tok < seq_len) & (tok >= first_key), other=0)
    tokens_loaded = tl.full([], 0, tl.int32)
    pages_loaded = tl.full([], 0, tl.int32)
    for tile in range(tile_lo, tile_hi):
        tok = tile * TILE + offs_t
        valid = (tok < seq_len) & (tok >= first_key)
        in_page = tok % BLOCK_SIZE
        if OFF32:  # every offset in the caches fits in int32 (checked at launch)
            k_off = page * stride_k_block + in_page * stride_k_tok
            v_off = page * stride_v_block + in_page * stride_v_tok
        else:
            k_off = page.to(tl.int64) * stride_k_block + in_page * stride_k_tok
            v_off = page.to(tl.int64) * stride_v_block + in_page * stride_v_tok
        k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        next_tok = tok + TILE
        page = tl.load(bt_row + next_tok // BLOCK_SIZE, mask=next_tok < seq_len, other=0)
        if COUNT_LOADS:
            # A page is counted where this program reads its first token: its first in-page
            # slot, or the first token the program reads at all.
            starts = valid & ((in_page == 0) | (tok == tl.maximum(tile_lo * TILE, first_key)))
            tokens_loaded += tl.sum(valid.to(tl.int32), 0)
            pages_loaded += tl.sum(starts.to(tl.int32), 0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2e
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    if COUNT_LOADS:  # (tokens, pages) of K read per sequence, summed over its KV heads
        tl.atomic_add(load_counts_ptr + seq * 2, tokens_loaded)
        tl.atomic_add(load_counts_ptr + seq * 2 + 1, pages_loaded)

    if SINGLE_SPLIT:
        # seq_len 0 marks a padding row (fixed-shape steps): nothing is written there.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & (seq_len > 0))
    else:
        # Workspace: acc [rows, HEAD_DIM], then m [rows], then l [rows], rows = (seq, head, split).
        # An empty split (short sequence) stores m = -inf, l = 0, acc = 0: weight 0 in the merge.
        rows = num_seqs.to(tl.int64) * num_heads * num_splits
        row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(workspace_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(workspace_ptr + rows * HEAD_DIM + row, m_i, mask=g_mask)
        tl.store(workspace_ptr + rows * (HEAD_DIM + 1) + row, l_i, mask=g_mask)
        if FUSED_MERGE:
            # All of this program's stores happen before its count (barrier, then a release
            # atomic); the last to count acquires everyone's stores and merges.
            tl.debug_barrier()
            counter = counters_ptr + seq * tl.num_programs(0) + kv_head
            done_before = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done_before == num_splits - 1:
                tl.store(counter, 0)  # every split has counted: ready for the next call
                _merge_group(workspace_ptr, out_ptr, seq, kv_head, seq_len, stride_o_seq, stride_o_head,
                             num_seqs, num_heads, num_splits, GROUP, GROUP_P2, HEAD_DIM, SPLITS_PAD, MERGE_CHUNK)


@triton.jit(do_not_specialize=["num_seqs", "num_heads", "num_splits"])
def _merge_splits_kernel(
    workspace_ptr, out_ptr, seq_lens_ptr,
    stride_o_seq, stride_o_head,
    num_seqs, num_heads, num_splits,
    SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    is_real = tl.load(seq_lens_ptr + seq) > 0   # a padding row (seq_len 0) is not written
    rows = num_seqs.to(tl.int64) * num_heads * num_splits
    first = (seq.to(tl.int64) * num_heads + head) * num_splits
    offs_s = tl.arange(0, SPLITS_PAD)
    m = tl.load(workspace_ptr + rows * HEAD_DIM + first + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    # Split 0 always holds the first token attended to, so m_max and every weight are finite.
    m_max = tl.max(m, 0)
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    l_sum = tl.zeros([CHUNK], tl.float32)
    for c in range(0, tl.cdiv(num_splits, CHUNK)):
        split = c * CHUNK + offs_c
        valid = split < num_splits
        row = first + split
        m_c = tl.load(workspace_ptr + rows * HEAD_DIM + row, mask=valid, other=float("-inf"))
        l_c = tl.load(workspace_ptr + rows * (HEAD_DIM + 1) + row, mask=valid, other=0.0)
        w = tl.exp2(m_c - m_max)
        part = tl.load(workspace_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None], other=0.0)
        acc += tl.sum(part * w[:, None], 0)
        l_sum += l_c * w
    out = acc / tl.sum(l_sum, 0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=(offs_d < HEAD_DIM) & is_real)


# Elements of one merge chunk (splits × group heads × head_dim, fp32) held by the last program.
_MERGE_CHUNK_ELEMENTS = 8192


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    counters: torch.Tensor | None = None,
    window: int | None = None,
    load_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its paged KV cache.

    q [num_seqs, num_heads, head_dim]; k_cache, v_cache [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables int32 [num_seqs, max_blocks_per_seq]; seq_lens int32 [num_seqs], each
    >= 1 (the tokens to attend to, this step's token included), or 0 for a padding row, whose
    output row is left untouched. Query head h reads KV head h // (num_heads // num_kv_heads).
    `scale` defaults to 1/sqrt(head_dim). With a sliding `window` (tokens, >= 1; None: full
    attention) the query at position seq_len - 1 attends to positions seq_len - window ..
    seq_len - 1 only, as vLLM's sliding-window layers do; the pages wholly before that range are
    not read.

    Returns out [num_seqs, num_heads, head_dim] in q's dtype (written into `out` if given).
    `workspace` is optional float32 scratch of at least `decode_workspace_numel(...)` elements;
    pass it (and `out`) preallocated to capture the call in a CUDA graph. `counters` is optional
    int32 scratch of at least num_seqs × num_kv_heads elements, all 0 before the first call (the
    kernel leaves them 0); by default a buffer shared by the calls on the device is used, which
    is fine for calls issued on one stream. `num_splits` and `config` override the tuned launch
    parameters (benchmarks, tests). `load_counts`, int32 [num_seqs, 2] (added to, not zeroed),
    receives per sequence the K tokens and the K pages the launch reads, summed over KV heads
    (V reads the same ones); it switches on a counting variant of the kernel (benchmarks, tests).
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    num_seqs, num_heads = check_query(q, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    cfg = config or decode_config(block_size, head_dim, q.dtype)
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1 token (or None), got {window}")
    if load_counts is not None and (load_counts.dtype != torch.int32 or load_counts.shape != (num_seqs, 2)):
        raise ValueError(f"load_counts must be int32 [{num_seqs}, 2]")
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        if window is not None:  # the tiles a query visits: those overlapping its window
            max_context = min(max_context, window + cfg.tile)
        num_splits = decode_num_splits(num_seqs, num_kv_heads, max_context, cfg.tile, sm_count(q.device))
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out

    single = num_splits == 1
    fused = False
    if single:
        workspace = counters = out  # not touched by the kernel
    else:
        need = decode_workspace_numel(num_seqs, num_heads, head_dim, num_splits)
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.float32, device=q.device)
        elif workspace.dtype != torch.float32 or workspace.numel() < need:
            raise ValueError(f"workspace must be float32 with at least {need} elements")
        if cfg.fused_merge:
            if counters is None:
                counters = split_counters(q.device, num_seqs * num_kv_heads)
            elif counters.dtype != torch.int32 or counters.numel() < num_seqs * num_kv_heads:
                raise ValueError(f"counters must be int32 with at least {num_seqs * num_kv_heads} elements")
            fused = counters is not None  # None: capturing with too small a buffer; merge apart
        if not fused:
            counters = workspace  # not touched by the kernel

    splits_pad = next_pow2(num_splits)
    # The in-kernel merge pads the split count to at least 64, so that one compiled kernel
    # serves every split count up to 64 (CUDA-graph buckets of different batch sizes).
    merge_pad = max(64, splits_pad)
    group_p2 = max(2, next_pow2(group))
    merge_chunk = max(2, min(merge_pad, _MERGE_CHUNK_ELEMENTS // (group_p2 * head_dim)))
    scale_log2e = default_scale(head_dim, scale) * LOG2E
    _paged_decode_kernel[(num_kv_heads, num_splits, num_seqs)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, workspace, counters,
        scale_log2e,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_seqs, num_heads, num_splits, window or 0, out if load_counts is None else load_counts,
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE=cfg.tile, SINGLE_SPLIT=single,
        FUSED_MERGE=fused, GROUP_P2=group_p2, SPLITS_PAD=merge_pad if fused else 1,
        MERGE_CHUNK=merge_chunk if fused else 1,
        OFF32=offsets_fit_int32(k_cache, v_cache), PRECISION=DOT_PRECISION,
        HAS_WINDOW=window is not None, COUNT_LOADS=load_counts is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not single and not fused:
        _merge_splits_kernel[(num_heads, num_seqs)](
            workspace, out, seq_lens,
            out.stride(0), out.stride(1),
            num_seqs, num_heads, num_splits,
            SPLITS_PAD=splits_pad, CHUNK=min(splits_pad, 16), HEAD_DIM=head_dim,
            num_warps=4,
        )
    return out
