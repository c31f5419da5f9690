"""Attention over the paged KV cache: where a step's tokens go and what they attend to
(`AttentionMetadata`), and two backends behind the same four calls (write, prefill, decode,
copy_blocks): the Triton kernels (`simkv.gpu.kernels`) or their torch reference
(`simkv.gpu.reference`). `scale` is the attention scores' (None: head_dim ** -0.5)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


class TritonAttention:
    """`simkv.gpu.kernels` (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""

    name = "triton"
    fused_elementwise = True

    def __init__(self):
        from simkv.gpu import kernels
        self.kernels = kernels

    def write(self, key, value, k_cache, v_cache, slot_mapping):
        self.kernels.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
                window=None, scale=None):
        self.kernels.paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                             seq_lens, scale=scale, out=out, window=window)

    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, out, workspace=None, window=None,
               scale=None):
        self.kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                            scale=scale, out=out, workspace=workspace,
                                            window=window)

    def copy_blocks(self, k_cache, v_cache, block_mapping):
        self.kernels.copy_blocks(k_cache, v_cache, block_mapping)


class ReferenceAttention:
    """`simkv.gpu.reference`: slow, exact (float64 on CPU)."""

    name = "reference"
    fused_elementwise = False

    def __init__(self):
        from simkv.gpu import reference
        self.ref = reference

    def write(self, key, value, k_cache, v_cache, slot_mapping):
        self.ref.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)

    def prefill(self, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
                window=None, scale=None):
        self.ref.paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                         seq_lens, scale=scale, out=out, window=window)

    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, out, workspace=None, window=None,
               scale=None):
        self.ref.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                        out=out, window=window)

    def copy_blocks(self, k_cache, v_cache, block_mapping):
        self.ref.copy_blocks(k_cache, v_cache, block_mapping)


def make_attention(name: str):
    if name == "triton":
        return TritonAttention()
    if name == "reference":
        return ReferenceAttention()
    raise ValueError(f"attention must be 'triton' or 'reference', got {name!r}")


@dataclass
class AttentionMetadata:
    """Where this step's tokens go and what they attend to (device tensors).

    Rows [0, num_prefill_tokens) of the batch are prefill chunks (varlen, `query_start_loc`),
    rows [num_prefill_tokens, num_tokens) one query token per sequence.
    """

    slot_mapping: torch.Tensor                        # int64 [num_tokens]; -1 = padding
    num_prefill_tokens: int = 0
    prefill_block_tables: Optional[torch.Tensor] = None  # int32 [num_prefill_seqs, blocks]
    prefill_query_start_loc: Optional[torch.Tensor] = None  # int32 [num_prefill_seqs + 1]
    prefill_seq_lens: Optional[torch.Tensor] = None      # int32 [num_prefill_seqs]
    decode_block_tables: Optional[torch.Tensor] = None   # int32 [num_decode_seqs, blocks]
    decode_seq_lens: Optional[torch.Tensor] = None       # int32 [num_decode_seqs]
    decode_workspace: Optional[torch.Tensor] = None      # float32 scratch (CUDA graphs)
    # Fixed-shape layout (mixed-step CUDA graphs): the decode kernel covers rows
    # [0, len(decode_seq_lens)) and the prefill kernel all rows, each by its metadata; rows of
    # seq_len 0 and rows outside query_start_loc's range are padding (computed, never sampled).
    fixed_shape: bool = False
    # KV cache groups: per group (the KV manager's order) its slot_mapping and block tables
    # (the other fields unused there); a layer reads its group's. None: one group, these fields.
    groups: Optional[list] = None
