"""KV cache groups: how a model's layers share one block pool, as vLLM's hybrid allocator lays
them out (vllm/v1/core/kv_cache_utils.py, get_kv_cache_groups and get_kv_cache_config_from_groups;
the per-layer specs in vllm/v1/kv_cache_interface.py).

Each layer keeps its KV in one of three ways: full attention (every token, growing; MLA stores
one latent per token), a sliding window (the last `window` tokens: blocks that leave it are
freed), linear attention (a constant state per sequence). Layers of one kind form groups of
`group_size` layers; one pool block holds a page of every layer of one group, so a block is
`group_size x page_bytes` and every group draws blocks from the same pool:

- one kind only (every model before hybrids): one group of all layers, page = block_size x one
  layer's bytes per token; a block holds the block_size tokens of every layer, as before;
- several kinds: layers grouped by kind, group_size = the fewest layers of a kind (the most
  when that is under 1.5x the fewest), a kind split into ceil(layers / group_size) groups
  (layers[i::n]: the last ones may be short, vLLM pads them); pages unified to the largest by
  raising a smaller page's block size (unify_kv_cache_spec_page_size);
- linear attention beside attention (Qwen3-Next): the attention block size is raised to the
  smallest multiple of 16 whose page holds a layer's state, and the state page is padded to it
  (vllm/model_executor/models/config.py, HybridAttentionMambaModelConfig); the state is one
  block per sequence (mamba_cache_mode 'none', a block of max_model_len tokens).

num_blocks = kv_pool_bytes // page_bytes // group_size (get_num_blocks). A request of
max_model_len tokens needs, per group, its largest use (max_memory_usage_bytes): full
ceil(len / block_size) blocks, a window ceil(min(window - 1 + max_num_batched_tokens, len) /
block_size) + 1, a linear state 1; the maximum concurrency is num_blocks over their sum
(get_max_concurrency_for_kv_cache_config).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

KINDS = ("full", "sliding", "linear")
_KIND_OF = {"full_attention": "full", "sliding_attention": "sliding",
            "linear_attention": "linear"}
# vLLM raises the attention block size for linear-attention hybrids in steps of 16 tokens
ATTENTION_BLOCK_ALIGN = 16
# FlashMLA (Hopper) needs a multiple of 64 tokens per block: vLLM forces 64 otherwise
# (vllm/platforms/cuda.py, CudaPlatformBase.check_and_update_config)
FLASHMLA_BLOCK = 64
HOPPER_GPUS = ("h100", "h200")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: `layers` (indices) of one kind sharing a block table."""

    index: int
    kind: str                    # full | sliding | linear
    layers: tuple
    block_size: int              # tokens per block (a linear state: max_model_len)
    window: Optional[int]        # sliding: tokens attended to
    bytes_per_token: int         # attention: summed over the group's layers (0 for linear)
    state_bytes: int             # linear: one sequence's state summed over the layers

    def max_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of max_model_len tokens holds at most in this group (vLLM's
        max_memory_usage_bytes over the page size)."""
        if self.kind == "linear":
            return 1
        if self.kind == "sliding":
            tokens = min(self.window - 1 + max_num_batched_tokens, max_model_len)
            return _cdiv(tokens, self.block_size) + 1
        return _cdiv(max_model_len, self.block_size)

    def to_dict(self) -> dict:
        return {"group": self.index, "attention_type": self.kind, "layers": list(self.layers),
                "num_layers": len(self.layers), "window": self.window,
                "block_size": self.block_size, "bytes_per_token": self.bytes_per_token,
                "state_bytes": self.state_bytes}


@dataclass(frozen=True)
class KVGeometry:
    """A model's KV cache groups on one pool (module docstring)."""

    groups: tuple
    block_size: int              # tokens per block of the attention groups
    page_bytes: int              # one layer's block (every group's, after unification)
    group_size: int              # layers per group (pool tensors)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one pool block: a page of each of group_size layers."""
        return self.page_bytes * self.group_size

    @property
    def bytes_per_token(self) -> int:
        """bytes_per_block / block_size: what one token slot of a pool block costs."""
        return self.bytes_per_block // self.block_size

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Pool blocks one request of max_model_len tokens needs at most, all groups."""
        return sum(g.max_blocks(max_model_len, max_num_batched_tokens) for g in self.groups)

    def max_concurrency(self, num_gpu_blocks: int, max_model_len: int,
                        max_num_batched_tokens: int) -> float:
        """Requests of max_model_len tokens the pool holds at once, as vLLM reports it
        ("Maximum concurrency for N tokens per request"; num_gpu_blocks counts its null block)."""
        return num_gpu_blocks / self.blocks_per_request(max_model_len, max_num_batched_tokens)


def effective_block_size(model, gpu_name: str, block_size: int, max_model_len: int) -> int:
    """The attention block size vLLM runs `model` with when asked for `block_size`: raised for a
    linear-attention hybrid until a page holds a layer's state; 64 for MLA on Hopper when the
    asked size is not a multiple of 64 (FlashMLA)."""
    if model.kv_lora_rank is not None and gpu_name.lower() in HOPPER_GPUS \
            and block_size % FLASHMLA_BLOCK:
        return FLASHMLA_BLOCK
    if "linear_attention" in model.attention_types:
        per_token = model.kv_bytes_per_layer_token("bf16")
        state = model.linear_state_bytes()
        need = ATTENTION_BLOCK_ALIGN * _cdiv(state, ATTENTION_BLOCK_ALIGN * per_token)
        return max(block_size, need)
    return block_size


def kv_geometry(model, per_layer: int, block_size: int, max_model_len: int,
                state: int = 0) -> KVGeometry:
    """The KV cache groups of `model` at `block_size` tokens per block (the effective one:
    `effective_block_size`), `per_layer` KV bytes per token in one attention layer and `state`
    bytes per sequence in one linear-attention layer (one GPU's share under tensor
    parallelism)."""
    by_kind: dict = {}
    for i, t in enumerate(model.attention_types):
        by_kind.setdefault(_KIND_OF[t], []).append(i)
    if len(by_kind) == 1:                            # one spec for every layer: one group
        (kind, layers), = by_kind.items()
        group = KVGroup(0, kind, tuple(layers), block_size,
                        model.sliding_window if kind == "sliding" else None,
                        per_layer * len(layers), 0)
        return KVGeometry((group,), block_size, per_layer * block_size, len(layers))
    counts = [len(v) for v in by_kind.values()]
    group_size = min(counts)
    if max(counts) < 1.5 * group_size:
        group_size = max(counts)
    page = per_layer * block_size
    if state > page:
        raise ValueError(f"{model.name}: a linear-attention state ({state} bytes) exceeds the "
                         f"attention page ({page} bytes); use effective_block_size")
    groups = []
    for kind, layers in by_kind.items():             # kinds in the order layers show them
        n = _cdiv(len(layers), group_size)
        for j in range(n):
            members = tuple(layers[j::n])
            if kind == "linear":
                groups.append(KVGroup(len(groups), kind, members, max_model_len, None, 0,
                                      state * len(members)))
            else:
                groups.append(KVGroup(len(groups), kind, members, block_size,
                                      model.sliding_window if kind == "sliding" else None,
                                      per_layer * len(members), 0))
    return KVGeometry(tuple(groups), block_size, page, group_size)
