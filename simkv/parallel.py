"""Tensor parallelism: how one replica's model is split over its `tensor_parallel_size` GPUs.

vLLM's rules (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py, and the model
files), which this module applies to the checkpoint's tensors (simkv.weights) to get one rank's:

- Column-parallel linears (q/k/v, gate/up, an MLA's q_b/kv_b, each expert's gate/up) split their
  output features over the ranks; row-parallel ones (o, down, each expert's down) their input
  features, and sum the ranks' partial outputs with an all-reduce.
- Attention heads split evenly: num_attention_heads must be a multiple of the rank count. KV
  heads split when there are at least as many as ranks (a multiple of them); with fewer, every
  rank holds one KV head and each KV head is replicated on tp / num_kv_heads ranks (the rank
  count must be a multiple of num_key_value_heads), as QKVParallelLinear does.
- An MLA model (DeepSeek-V3) caches one latent per token and layer that every rank needs: the
  latent's projection (kv_a_proj_with_mqa) and q_a_proj are replicated linears, and every rank
  caches the whole latent.
- The embedding table and the LM head are vocab-parallel: the vocabulary, padded to a multiple
  of 64 (DEFAULT_VOCAB_PADDING_SIZE), split evenly; the embedding's partial outputs are summed
  by an all-reduce, the LM head's logits gathered.
- Norms, routers (ReplicatedLinear), row-parallel biases and attention sinks' shares are kept
  whole or split as named in `shard`; experts split their width over the ranks (tensor-parallel
  experts, no expert parallelism).

With tensor_parallel_size 1 every figure is the model's own (no padding, no copies), so a
replica of one GPU sizes and costs exactly as before this module.
"""
from __future__ import annotations

from typing import Optional

from simkv.weights import Weight, tensor_bytes

MAX_TENSOR_PARALLEL_SIZE = 16     # sizing accepts up to two 8-GPU nodes
VOCAB_PADDING = 64                # vLLM's DEFAULT_VOCAB_PADDING_SIZE

# Tensors every rank holds whole (module name endings; norms are matched by part).
_REPLICATED = ("q_a_proj", "kv_a_proj_with_mqa", "o_proj.bias", "down_proj_bias",
               "block_sparse_moe.gate", "mlp.gate", "mlp.router", "router.bias",
               "e_score_correction_bias")
# Column-parallel: output features (rows) split.
_COLUMN = ("q_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "w1", "w3",
           "gate_up_proj", "gate_up_proj_bias")
# Row-parallel: input features (cols) split.
_ROW = ("o_proj", "down_proj", "w2")


def profile_name(model_name: str, tensor_parallel_size: int) -> str:
    """The profile folder of a model at this TP size: `llama-3.1-70b-tp2` (TP 1: the name)."""
    return model_name if tensor_parallel_size == 1 else f"{model_name}-tp{tensor_parallel_size}"


def check(model, tensor_parallel_size: int) -> Optional[str]:
    """Why `model` cannot be split over `tensor_parallel_size` ranks (one line), or None."""
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_TENSOR_PARALLEL_SIZE:
        return f"{tp!r} is not an integer in 1..{MAX_TENSOR_PARALLEL_SIZE}"
    if tp == 1:
        return None
    need = [("num_attention_heads", model.num_heads)]
    if model.intermediate_size and (model.experts is None
                                    or model.experts.num_moe_layers < model.num_layers):
        need.append(("intermediate_size", model.intermediate_size))
    if model.experts is not None:
        need.append(("the experts' intermediate size", model.experts.expert_intermediate_size))
    for what, value in need:
        if value % tp:
            return (f"{tp} does not divide {model.name}'s {what} ({value}): "
                    f"use a size that does ({_divisors(value)})")
    unknown = next((w.module for w in model.weights if _rule(w) is None), None)
    if unknown is not None:
        return (f"{model.name} ({model.architecture}) has {unknown}, whose tensor-parallel "
                "split simkv does not model yet: size it at tensor_parallel_size 1")
    kv = model.num_kv_heads
    if model.kv_lora_rank is None and kv % tp and tp % kv:
        return (f"{tp} ranks cannot share {model.name}'s {kv} KV heads: the rank count must "
                f"divide them or be a multiple of them ({_divisors(kv)}, or multiples of {kv})")
    return None


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, MAX_TENSOR_PARALLEL_SIZE + 1) if n % d == 0)


def kv_heads_per_rank(model, tensor_parallel_size: int) -> int:
    """KV heads each rank caches: num_kv_heads / tp, at least 1 (replicated below that)."""
    return max(1, model.num_kv_heads // tensor_parallel_size)


def kv_bytes_per_token(model, kv_dtype: str, tensor_parallel_size: int) -> int:
    """KV bytes one token occupies on each rank: the rank's share of the KV heads of the
    model's figure (model.kv_bytes_per_token); an MLA latent is whole on every rank."""
    whole = model.kv_bytes_per_token(kv_dtype)
    if tensor_parallel_size == 1 or model.kv_lora_rank is not None:
        return whole
    return whole * kv_heads_per_rank(model, tensor_parallel_size) // model.num_kv_heads


def padded_vocab_rows(vocab_size: int, tensor_parallel_size: int) -> int:
    """Rows of the embedding table (and the LM head) on each rank."""
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    return -(-padded // tensor_parallel_size)


def _rule(w: Weight) -> Optional[str]:
    """How `w` is split: vocab, replicated, kv, qkv_bias, mlp_bias, heads, column, row; or
    None when no rule covers it."""
    name = w.module
    if w.part in ("embedding", "lm_head"):
        return "vocab"
    if w.part == "norm" or name.endswith(_REPLICATED):
        return "replicated"
    for rule, ends in (("kv", ("k_proj", "v_proj")), ("qkv_bias", ("qkv.bias",)),
                       ("mlp_bias", ("mlp.bias",)), ("heads", ("sinks",)),
                       ("column", _COLUMN), ("row", _ROW)):
        if name.endswith(ends):
            return rule
    return None


def shard(w: Weight, model, tensor_parallel_size: int) -> Weight:
    """One rank's part of the checkpoint tensor group `w` (a model `check` accepts)."""
    tp = tensor_parallel_size
    if tp == 1:
        return w
    name = w.module
    if w.part in ("embedding", "lm_head"):
        return Weight(name, w.part, padded_vocab_rows(w.rows, tp), w.cols, w.count, w.is_matrix)
    if w.part == "norm" or name.endswith(_REPLICATED):
        return w
    kvr = kv_heads_per_rank(model, tp) * model.head_dim
    if name.endswith(("k_proj", "v_proj")):
        return Weight(name, w.part, kvr, w.cols, w.count, w.is_matrix)
    if name.endswith("qkv.bias"):        # q's share of the heads, the rank's KV heads
        q_out = model.num_heads * model.head_dim
        return Weight(name, w.part, 1, q_out // tp + 2 * kvr, w.count, w.is_matrix)
    if name.endswith("mlp.bias"):        # gate and up biases split, down's kept whole
        return Weight(name, w.part, 1, (w.cols - model.hidden_size) // tp + model.hidden_size,
                      w.count, w.is_matrix)
    if name.endswith("sinks"):           # one per attention head
        return Weight(name, w.part, 1, w.cols // tp, w.count, w.is_matrix)
    if name.endswith(_COLUMN):
        if w.rows == 1:                  # a vector: its features split
            return Weight(name, w.part, 1, w.cols // tp, w.count, w.is_matrix)
        return Weight(name, w.part, w.rows // tp, w.cols, w.count, w.is_matrix)
    if name.endswith(_ROW):
        return Weight(name, w.part, w.rows, w.cols // tp, w.count, w.is_matrix)
    raise AssertionError(f"no tensor-parallel rule for {name}")


def rank_weights(model, tensor_parallel_size: int) -> list:
    """Every tensor group one rank holds (simkv.weights.Weight, shapes per rank)."""
    return [shard(w, model, tensor_parallel_size) for w in model.weights]


def rank_weight_bytes(model, tensor_parallel_size: int) -> int:
    """Bytes of weights on each rank (the checkpoint's quantization applied to each shard)."""
    if tensor_parallel_size == 1:
        return model.weight_bytes()
    return sum(tensor_bytes(w, model.quantization)
               for w in rank_weights(model, tensor_parallel_size))


def rank_params_by_part(model, tensor_parallel_size: int) -> dict:
    """Parameters one rank holds, per model part (simkv.weights.PARTS)."""
    out: dict = {}
    for w in rank_weights(model, tensor_parallel_size):
        out[w.part] = out.get(w.part, 0) + w.params
    return out


def rank_bytes_by_part(model, tensor_parallel_size: int) -> dict:
    """Bytes of weights one rank holds, per model part (the checkpoint's quantization)."""
    out: dict = {}
    for w in rank_weights(model, tensor_parallel_size):
        out[w.part] = out.get(w.part, 0) + tensor_bytes(w, model.quantization)
    return out
