"""Paged prefill attention: causal varlen attention of new tokens over a paged KV cache.

The new tokens of every sequence sit back to back in q (`query_start_loc` marks where each
sequence starts); their K/V are already in the cache, behind any cached prefix. Query token i of
sequence s sits at position seq_lens[s] - q_len_s + i and sees keys 0..that position (with a
sliding window of W tokens, the last W of them).

One program handles BLOCK_M query tokens of one sequence for one query head. Programs are laid
out over the flattened query tokens with one spare tile per sequence (sequence s owns tiles from
query_start_loc[s] // BLOCK_M + s), so the grid depends only on shapes; a program finds its
sequence by binary search and exits with no work if its tile lies past the sequence's end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import DOT_PRECISION, LOG2E, check_kv_cache, check_query, default_scale, offsets_fit_int32


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel: query and key tile sizes, warps, pipeline depth,
    and whether block-table entries are loaded one key tile ahead by hand (True) or left to the
    compiler's pipeliner (False)."""

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3
    prefetch_pages: bool = True


def prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Launch configuration: BLOCK_M 64, BLOCK_N 32, 4 warps, 3 stages, block-table entries
    loaded a tile ahead, for 16-bit inputs (the fastest of the bounded tune on an H200 at 8 x 2,048
    new tokens: 350 TFLOP/s, 64% of SDPA causal; profiles/h200/kernels-tuned/); fp32 and head_dim
    256 from the compiler's register report, not timed."""
    if dtype == torch.float32:  # IEEE fp32 dots run on FMA units and need many registers
        return PrefillConfig(block_m=32, block_n=32, num_warps=8, num_stages=2)
    if head_dim > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    return PrefillConfig()


@triton.jit
def _online_softmax_step(q, k, v, m_i, l_i, acc, scale_log2e, mask, PRECISION: tl.constexpr, MASKED: tl.constexpr,
                         SAFE: tl.constexpr = False):
    # Scores in log2 units; the max is taken before scaling so that scale and shift are one FMA.
    # SAFE: a row may have seen no key yet (a sliding window starts after this tile); its max
    # stays -inf and it is shifted by 0 instead, so that it adds nothing rather than NaN.
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASKED:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2e)
    if SAFE:
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_shift = m_new
    p = tl.exp2(s * scale_log2e - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _tile_pages(bt_row, first_key, offs_n, seq_len, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    # Page number of each key of the tile starting at `first_key` (a scalar if one page holds
    # the whole tile). Keys past the sequence read page 0, which they never use.
    if BLOCK_SIZE >= BLOCK_N:
        return tl.load(bt_row + first_key // BLOCK_SIZE, mask=first_key < seq_len, other=0)
    else:
        key = first_key + offs_n
        return tl.load(bt_row + key // BLOCK_SIZE, mask=key < seq_len, other=0)


@triton.jit
def _kv_offsets(page, key, stride_k_block, stride_k_tok, stride_v_block, stride_v_tok,
                BLOCK_SIZE: tl.constexpr, OFF32: tl.constexpr):
    # Element offsets of the keys' rows from the head's first element; int32 arithmetic when
    # every offset in the caches fits (checked at launch), else int64.
    in_page = key % BLOCK_SIZE
    if OFF32:
        return page * stride_k_block + in_page * stride_k_tok, page * stride_v_block + in_page * stride_v_tok
    else:
        page64 = page.to(tl.int64)
        return page64 * stride_k_block + in_page * stride_k_tok, page64 * stride_v_block + in_page * stride_v_tok


# num_seqs == 1 would otherwise be specialised into a Python constant.
@triton.jit(do_not_specialize=["num_seqs", "window"])
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    scale_log2e,
    stride_q_tok, stride_q_head,
    stride_k_block, stride_k_tok, stride_k_head,
    stride_v_block, stride_v_tok, stride_v_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    num_seqs, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH_PAGES: tl.constexpr, OFF32: tl.constexpr,
    PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    head = tl.program_id(0)
    # Highest tiles first: under the causal mask they carry the most work, so the tail is short.
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    kv_head = head // GROUP

    # Last sequence whose first tile index is <= tile. Query offsets are taken relative to the
    # first sequence's, which need not be 0 (a fixed-shape step puts other rows before it).
    q_base = tl.load(query_start_loc_ptr)
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = (tl.load(query_start_loc_ptr + mid) - q_base) // BLOCK_M + mid
        go_right = first_tile <= tile
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    m_start = (tile - ((q_start - q_base) // BLOCK_M + seq)) * BLOCK_M
    has_work = m_start < q_len
    context_start = seq_len - q_len  # position of this chunk's first token

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = offs_m < q_len
    pos = context_start + offs_m

    tok_idx = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tok_idx[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=row_valid[:, None], other=0.0,
    )
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head = k_ptr + kv_head.to(tl.int64) * stride_k_head
    v_head = v_ptr + kv_head.to(tl.int64) * stride_v_head

    # Keys below the tile's first position are visible to every row (causally): no mask there.
    first_pos = context_start + m_start
    last_pos = context_start + tl.minimum(m_start + BLOCK_M, q_len) - 1
    n_full = tl.where(has_work, (first_pos + 1) // BLOCK_N, 0)
    n_all = tl.where(has_work, tl.cdiv(last_pos + 1, BLOCK_N), 0)
    # Key tiles [kt_lo, kt_win) need the window mask; [kt_win, kt_causal) no mask at all;
    # [kt_causal, n_all) the causal mask. A row at position p sees keys p - window + 1 .. p, so
    # keys before the first row's window are seen by no row: their tiles are never visited and
    # their slots in a partly visited tile are not loaded.
    if HAS_WINDOW:
        first_key = tl.maximum(first_pos - window + 1, 0)
        kt_lo = tl.where(has_work, first_key // BLOCK_N, 0)
        kt_win = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N)
        kt_win = tl.minimum(tl.maximum(kt_win, kt_lo), n_all)
    else:
        first_key = 0
        kt_lo = 0
        kt_win = 0
    kt_causal = tl.minimum(tl.maximum(n_full, kt_win), n_all)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # With PREFETCH_PAGES the page numbers are loaded one key tile ahead, so that the K/V loads
    # of a tile depend on no load of the same iteration; without, the block-table load stays in
    # the iteration and the compiler's pipeliner schedules it (an indirect load) stages ahead.
    # When a page holds whole key tiles (BLOCK_SIZE >= BLOCK_N) a tile needs one page number.
    page = _tile_pages(bt_row, kt_lo * BLOCK_N, offs_n, seq_len, BLOCK_SIZE, BLOCK_N)
    if HAS_WINDOW:
        for kt in range(kt_lo, kt_win):
            if not PREFETCH_PAGES:
                page = _tile_pages(bt_row, kt * BLOCK_N, offs_n, seq_len, BLOCK_SIZE, BLOCK_N)
            key = kt * BLOCK_N + offs_n
            key_valid = (key < seq_len) & (key >= first_key)
            k_off, v_off = _kv_offsets(page, key, stride_k_block, stride_k_tok, stride_v_block, stride_v_tok,
                                       BLOCK_SIZE, OFF32)
            k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=key_valid[:, None], other=0.0)
            v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=key_valid[:, None], other=0.0)
            if PREFETCH_PAGES:
                page = _tile_pages(bt_row, (kt + 1) * BLOCK_N, offs_n, seq_len, BLOCK_SIZE, BLOCK_N)
            seen = (key[None, :] <= pos[:, None]) & (key[None, :] > pos[:, None] - window) & key_valid[None, :]
            m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, scale_log2e, seen, PRECISION, True, True)
    for kt in range(kt_win, kt_causal):
        if not PREFETCH_PAGES:
            page = _tile_pages(bt_row, kt * BLOCK_N, offs_n, seq_len, BLOCK_SIZE, BLOCK_N)
        key = kt * BLOCK_N + offs_n
        k_off, v_off = _kv_offsets(page, key, stride_k_block, stride_k_tok, stride_v_block, stride_v_tok,
                                   BLOCK_SIZE, OFF32)
        k = tl.load(k_head + k_off[:, None] + offs_d[None, :])
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :])
        if PREFETCH_PAGES:
            page = _tile_pages(bt_row, (kt + 1) * BLOCK_N, offs_n, seq_len, BLOCK_SIZE, BLOCK_N)
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, scale_log2e, None, PRECISION, False)
    for kt in range(kt_causal, n_all):
        if not PREFETCH_PAGES:
            page = _tile_pages(bt_row, kt * BLOCK_N, offs_n, seq_len, BLOCK_SIZE, BLOCK_N)
        key = kt * BLOCK_N + offs_n
        key_valid = key < seq_len
        k_off, v_off = _kv_offsets(page, key, stride_k_block, stride_k_tok, stride_v_block, stride_v_tok,
                                   BLOCK_SIZE, OFF32)
        k = tl.load(k_head + k_off[:, None] + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        v = tl.load(v_head + v_off[:, None] + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        if PREFETCH_PAGES:
            page = _tile_pages(bt_row, (kt + 1) * BLOCK_N, offs_n, seq_len, BLOCK_SIZE, BLOCK_N)
        causal = (key[None, :] <= pos[:, None]) & key_valid[None, :]
        m_i, l_i, acc = _online_softmax_step(q, k, v, m_i, l_i, acc, scale_log2e, causal, PRECISION, True,
                                             HAS_WINDOW)

    # Rows past the chunk's end are never stored; keep their division finite anyway.
    l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tok_idx[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    config: PrefillConfig | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a chunk of new tokens per sequence over the paged cache.

    q [total_query_tokens, num_heads, head_dim], sequences back to back; query_start_loc int32
    [num_seqs + 1]: the row of each sequence's first new token, then the end of the last one
    (usually 0 and the cumulative query lengths; rows outside [query_start_loc[0],
    query_start_loc[-1]) are neither read nor written, and a sequence may have no new tokens); seq_lens int32 [num_seqs]: context length
    including this step's tokens, whose K/V are already in the cache. Query token i of sequence s
    is at position seq_lens[s] - q_len_s + i. `scale` defaults to 1/sqrt(head_dim). With a
    sliding `window` (tokens, >= 1; None: full attention) the token at position p attends to
    positions p - window + 1 .. p only; key tiles before every row's window are not read.

    Returns out [total_query_tokens, num_heads, head_dim] in q's dtype (into `out` if given).
    Needs no scratch and no host sync, so it can be captured in a CUDA graph as is.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    total_tokens, num_heads = check_query(q, num_kv_heads, head_dim)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError("query_start_loc must have num_seqs + 1 entries")
    cfg = config or prefill_config(head_dim, q.dtype)
    if window is not None and window < 1:
        raise ValueError(f"window must be at least 1 token (or None), got {window}")
    if out is None:
        out = torch.empty_like(q)
    if total_tokens == 0 or num_seqs == 0:
        return out
    num_tiles = total_tokens // cfg.block_m + num_seqs   # enough for any query_start_loc
    _paged_prefill_kernel[(num_heads, num_tiles)](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        default_scale(head_dim, scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_seqs, window or 0,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PREFETCH_PAGES=cfg.prefetch_pages,
        OFF32=offsets_fit_int32(k_cache, v_cache), PRECISION=DOT_PRECISION, HAS_WINDOW=window is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
