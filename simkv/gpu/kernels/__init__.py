"""Triton kernels over a paged KV cache (one layer's cache per call).

Layouts (INTERFACE.md, "Kernels"): k_cache, v_cache [num_blocks, block_size, num_kv_heads,
head_dim]; block tables int32 [num_seqs, max_blocks_per_seq]. The kernels run on CUDA tensors, or
on CPU tensors when TRITON_INTERPRET=1 was set before this package was imported (tests).
"""

from ._common import INTERPRET
from .cache_ops import copy_blocks, reshape_and_cache
from .decode import DecodeConfig, decode_config, decode_num_splits, decode_workspace_numel, paged_decode_attention
from .prefill import PrefillConfig, paged_prefill_attention, prefill_config

__all__ = [
    "INTERPRET",
    "DecodeConfig",
    "PrefillConfig",
    "copy_blocks",
    "decode_config",
    "decode_num_splits",
    "decode_workspace_numel",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prefill_config",
    "reshape_and_cache",
]
