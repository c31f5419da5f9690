"""Writes into the paged cache: new tokens' K/V by slot (reshape_and_cache) and block copies."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_kv_cache, next_pow2


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_ptr, v_ptr, slot_mapping_ptr,
    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
    stride_k_block, stride_k_tok, stride_k_head,
    stride_v_block, stride_v_tok, stride_v_head,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    # A negative slot (padding token) writes nothing.
    mask = ((offs_h < NUM_KV_HEADS) & (slot >= 0))[:, None]
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    in_block = tl.maximum(slot, 0) % BLOCK_SIZE

    key = tl.load(key_ptr + tok * stride_key_tok + offs_h[:, None] * stride_key_head + offs_d[None, :], mask=mask)
    dst = block * stride_k_block + in_block * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :]
    tl.store(k_ptr + dst, key.to(k_ptr.dtype.element_ty), mask=mask)
    value = tl.load(
        value_ptr + tok * stride_value_tok + offs_h[:, None] * stride_value_head + offs_d[None, :], mask=mask
    )
    dst = block * stride_v_block + in_block * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :]
    tl.store(v_ptr + dst, value.to(v_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V into its cache slot, in place.

    key, value [num_tokens, num_kv_heads, head_dim] (cast to the cache dtype); slot_mapping int64
    [num_tokens], slot = block_index * block_size + offset; a negative slot is skipped.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    num_tokens = key.shape[0]
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key/value must be [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(key.shape)}/{tuple(value.shape)}"
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in their last dimension")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=next_pow2(num_kv_heads), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        num_warps=4,
    )


@triton.jit
def _copy_blocks_kernel(
    k_ptr, v_ptr, block_mapping_ptr, block_numel,
    CHUNK: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    tl.store(k_ptr + dst * block_numel + offs, tl.load(k_ptr + src * block_numel + offs, mask=mask), mask=mask)
    tl.store(v_ptr + dst * block_numel + offs, tl.load(v_ptr + src * block_numel + offs, mask=mask), mask=mask)


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks within one layer's cache (copy-on-write), in place.

    block_mapping int64 [num_pairs, 2]: (src, dst) block indices. Pairs are copied in parallel,
    so no dst may also appear as a src in the same call.
    """
    check_kv_cache(k_cache, v_cache)
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2], got {tuple(block_mapping.shape)}")
    block_numel = k_cache[0].numel()
    for cache in (k_cache, v_cache):
        if not cache[0].is_contiguous() or cache.stride(0) != block_numel:
            raise ValueError("copy_blocks needs caches whose blocks are contiguous and stored back to back")
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    block_mapping = block_mapping.contiguous()
    chunk = min(4096, next_pow2(block_numel))
    _copy_blocks_kernel[(num_pairs, triton.cdiv(block_numel, chunk))](
        k_cache, v_cache, block_mapping, block_numel, CHUNK=chunk, num_warps=4,
    )
