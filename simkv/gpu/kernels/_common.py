"""Shared checks and device facts for the paged-attention kernels."""

from __future__ import annotations

import functools
import math

import torch
from triton import knobs

# Whether the kernels in this package were built for Triton's CPU interpreter. Triton decides
# this when a kernel is decorated, i.e. when this package is first imported.
INTERPRET: bool = bool(knobs.runtime.interpret)


def _fix_interpreter_scalar_index() -> None:
    """Let Triton 3.6's interpreter use scalars as loop bounds under numpy >= 2.4.

    The interpreter holds scalars as 1-element arrays and converts them with int(array), which
    numpy 2.4 refuses; upstream fixed it by squeezing first (triton-lang/triton#9171, PR #9172).
    """
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_simkv_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._simkv_fixed = True
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _fix_interpreter_scalar_index()

LOG2E = 1.4426950408889634

# fp32 dots must be IEEE fp32 (no TF32) so that fp32 runs compare tightly with the reference;
# the flag is ignored for 16-bit inputs, which accumulate in fp32 anyway.
DOT_PRECISION = "ieee"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def _sm_count_of(device_type: str, index: int | None) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(index).multi_processor_count
    return 4  # interpreter: keep the grid small, but still exercise split-K


def sm_count(device: torch.device) -> int:
    """Number of streaming multiprocessors of `device` (a small constant on CPU)."""
    index = device.index if device.type != "cuda" or device.index is not None else torch.cuda.current_device()
    return _sm_count_of(device.type, index)


def default_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate one layer's paged cache pair; returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"cache dtype must be one of {SUPPORTED_DTYPES}, got {k_cache.dtype}/{v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the last (head_dim) dimension of the caches must be contiguous")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_query(q: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """Validate q [rows, num_heads, head_dim] against the cache; returns (rows, num_heads)."""
    rows, num_heads, q_head_dim = q.shape
    if q_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache (kv heads {num_kv_heads}, head_dim {head_dim})")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dimension")
    return rows, num_heads


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def offsets_fit_int32(*caches: torch.Tensor) -> bool:
    """Whether every element offset inside each cache (from its first element) fits in int32, so
    that the kernels may compute page offsets without 64-bit multiplies."""
    for cache in caches:
        last = sum((size - 1) * stride for size, stride in zip(cache.shape, cache.stride()) if size > 0)
        if last >= 2**31 - 1:
            return False
    return True
