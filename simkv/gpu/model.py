"""A Llama-family decoder with deterministic random weights, over a paged KV cache.

RMSNorm, RoPE (rope_scaling: default, linear, llama3), grouped-query attention through the paged
kernels or their torch reference (`simkv.gpu.attention`), SwiGLU MLP;
Qwen2's q/k/v biases and Qwen3's per-head q/k norms; Qwen3-MoE's and Mixtral's routed experts in
place of the MLP on their MoE layers (`simkv.gpu.moe`: the fused grouped GEMMs with the Triton
backend, the plain torch loop with the reference one). Other MoE families are refused.

Gemma 3 (text; transformers' modeling_gemma3, vLLM's models/gemma3.py): the embedding times
sqrt(hidden_size) (the normaliser rounded to the weights' dtype); four RMSNorms per layer (input,
then one on the attention output before its residual add, one before the MLP and one on the MLP
output before its residual add); per-head q/k norms; GeGLU (gelu, tanh approximation) in place
of SwiGLU; attention scores scaled by query_pre_attn_scalar ** -0.5; sliding layers' RoPE at
rope_local_base_freq unscaled, full layers' at rope_theta with rope_scaling; tied embeddings,
no logit soft-capping. Gemma's RMSNorm scales by (1 + w); with random weights the model stores
the effective scale (1 + w), ones, as it does every norm's. The checkpoint's SigLIP vision tower
and projector are held as one allocated tensor of their bytes that nothing computes (the
engine serves text only): the weights the engine holds are then the bytes `simkv size` counts
(`ModelSpec.weight_bytes`), which its memory ledger and the validation's num_blocks rest on.

Nothing is downloaded: weights are drawn
from a seeded generator on the target device, scaled so that activations stay O(1) through the
layers (projections ~ 1/sqrt(fan_in); the two projections that write into the residual stream
are further scaled by 1/sqrt(2 * num_layers); Gemma's embedding ~ 1/sqrt(hidden_size), so that
the scaled embedding is O(1)).

One forward covers a flattened batch: prefill chunks first (rows [0, P)), then single-token
queries (rows [P, T)); or, in the fixed-shape layout of mixed-step CUDA graphs, single-token
queries first and padding rows that the attention kernels skip (`AttentionMetadata.fixed_shape`).
Each layer writes the K/V of *all* this step's tokens into the cache before any attention, so a
sequence may read blocks that another sequence of the same step computes (two identical prompts
admitted together share blocks through the prefix cache).

The KV cache is one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`
(`caches[l, 0]` is layer l's K, `caches[l, 1]` its V: the layout `simkv.gpu.swap` moves). With
KV cache groups (sliding-window layers beside full ones, `use_kv_groups`) layer j of each group
shares slot j, and each group has its own block tables; sliding layers attend to their window.

With the Triton backend the elementwise work (residual add + RMSNorm, RoPE, SiLU- or
GELU-and-mul) runs in small fused Triton kernels (`simkv.gpu.elementwise`), so a decode step is
~10 launches per layer (Gemma 3: two more norms); with the reference backend (CPU, float64) it
is plain torch.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import triton

from simkv.gpu.attention import AttentionMetadata, make_attention
from simkv.gpu.elementwise import (act_and_mul_kernel, add_rms_norm_kernel, head_rms_norm_kernel,
                                   next_pow2, rope_kernel)
from simkv.gpu.moe import fused_moe, fused_route, reference_moe, route, router_config


# ----------------------------------------------------------------------------------------------
# RoPE frequencies


def rope_inv_freq(spec, dtype=torch.float64, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] of the model's RoPE, rope_scaling applied (CPU);
    `local`: Gemma 3's sliding layers' (base rope_local_base_freq, no scaling).

    Supported `rope_type`s: default, linear, llama3 (transformers' formulas); others raise.
    """
    dim = spec.head_dim
    base = spec.rope_local_base_freq if local else spec.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = {} if local else spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    else:
        raise ValueError(f"{spec.name}: rope_scaling type {kind!r} is not supported by the sample "
                         "model (default, linear, llama3)")
    return inv_freq.to(dtype)


# ----------------------------------------------------------------------------------------------
# The model


@dataclass
class LayerWeights:
    input_norm: torch.Tensor        # [hidden]
    qkv: torch.Tensor               # [(H + 2 KH) * D, hidden]
    o: torch.Tensor                 # [hidden, H * D]
    post_norm: torch.Tensor         # [hidden]
    gate_up: torch.Tensor           # [2 * intermediate, hidden]
    down: torch.Tensor              # [hidden, intermediate]
    qkv_bias: Optional[torch.Tensor] = None   # Qwen2
    q_norm: Optional[torch.Tensor] = None     # Qwen3, Gemma 3: [D]
    k_norm: Optional[torch.Tensor] = None
    # Gemma 3: norms of the attention's and the MLP's outputs before their residual adds
    # (its post_attention_layernorm and post_feedforward_layernorm; `post_norm` is then its
    # pre_feedforward_layernorm, the norm before the MLP as in Llama)
    attn_out_norm: Optional[torch.Tensor] = None
    mlp_out_norm: Optional[torch.Tensor] = None
    router: Optional[torch.Tensor] = None     # MoE layers: [E, hidden]; gate_up [E, 2 I, hidden]
                                              # and down [E, hidden, I] are the experts'


class LlamaModel:
    """The decoder. `forward` returns logits of the requested rows; caches are passed in."""

    def __init__(self, spec, device="cpu", dtype=torch.float64, seed: int = 0,
                 attention: str = "reference"):
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype
        self.attn = make_attention(attention) if isinstance(attention, str) else attention
        self.fused = self.attn.fused_elementwise
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.hidden_size = spec.hidden_size
        self.eps = float(spec.rms_norm_eps)
        self.router_cfg = router_config(spec) if spec.is_moe else None
        self.is_gemma3 = spec.architecture.startswith("Gemma3")
        # Gemma 3's embedding normaliser, rounded to the weights' dtype as transformers does
        self.embed_scale = float(torch.tensor(spec.hidden_size ** 0.5, dtype=dtype)) \
            if self.is_gemma3 else None
        self.gelu = (spec.hidden_activation or "silu") == "gelu_pytorch_tanh"
        # the kernels' default is head_dim ** -0.5
        self.attn_scale = spec.query_pre_attn_scalar ** -0.5 if spec.query_pre_attn_scalar \
            else None
        self._attention_layout(spec)
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        self.inv_freq = rope_inv_freq(spec).to(device=self.device, dtype=compute)
        # each layer's RoPE: Gemma 3's sliding layers have their own
        local = rope_inv_freq(spec, local=True).to(device=self.device, dtype=compute) \
            if spec.rope_local_base_freq else None
        self.layer_inv_freq = [local if w is not None and local is not None else self.inv_freq
                               for w in self.layer_windows]
        self._init_weights(seed)

    def _attention_layout(self, spec) -> None:
        """Each layer's sliding window (None: full attention) and its place in the caches: by
        default one cache slot per layer; `use_kv_groups` lets layers of different KV cache
        groups share slots, as vLLM's hybrid allocator does (a block serves one group at a time)."""
        types = tuple(getattr(spec, "attention_types", ()) or ("full_attention",) * spec.num_layers)
        if "linear_attention" in types:
            raise ValueError(f"{spec.name}: linear-attention layers are not in the sample model")
        self.layer_windows = [spec.sliding_window if t == "sliding_attention" else None for t in types]
        self.layer_group = [0] * spec.num_layers
        self.layer_slot = list(range(spec.num_layers))
        self.num_cache_slots = spec.num_layers

    def use_kv_groups(self, groups) -> None:
        """Lay the caches out by KV cache groups (`simkv.sizing` kv_groups entries, in the KV
        manager's order): layer j of group g uses slot j of the caches and group g's block
        tables (`AttentionMetadata.groups[g]`); caches allocated after this call have
        max(len(layers)) slots."""
        for g, group in enumerate(groups):
            for j, layer in enumerate(group["layers"]):
                self.layer_group[layer] = g
                self.layer_slot[layer] = j
        self.num_cache_slots = max(len(group["layers"]) for group in groups)

    # -- weights ------------------------------------------------------------------------------
    def _randn(self, seed: int, name: str, shape, std: float) -> torch.Tensor:
        """Standard normal × std, drawn on the model's device from a per-tensor seed."""
        gen = torch.Generator(device=self.device)
        gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & ((1 << 63) - 1))
        w = torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32)
        return w.mul_(std).to(self.dtype)

    def _init_weights(self, seed: int) -> None:
        s = self.spec
        H, KH, D, hidden, inter = s.num_heads, s.num_kv_heads, s.head_dim, s.hidden_size, \
            s.intermediate_size
        residual_scale = 1.0 / math.sqrt(2 * s.num_layers)
        ones = lambda n: torch.ones(n, device=self.device, dtype=self.dtype)  # noqa: E731
        self.embed = self._randn(seed, "embed", (s.vocab_size, hidden),
                                 hidden ** -0.5 if self.is_gemma3 else 1.0)
        self.layers = []
        moe_layers = set(s.experts.moe_layers) if s.is_moe else set()
        for i in range(s.num_layers):
            p = f"layers.{i}."
            # an MoE layer's experts: (E, I) stacked; a dense layer's MLP: one of width inter
            experts = (s.experts.num_experts,) if i in moe_layers else ()
            width = s.experts.expert_intermediate_size if i in moe_layers else inter
            layer = LayerWeights(
                input_norm=ones(hidden),
                qkv=self._randn(seed, p + "qkv", ((H + 2 * KH) * D, hidden), hidden ** -0.5),
                o=self._randn(seed, p + "o", (hidden, H * D), (H * D) ** -0.5 * residual_scale),
                post_norm=ones(hidden),
                gate_up=self._randn(seed, p + "gate_up", (*experts, 2 * width, hidden), hidden ** -0.5),
                down=self._randn(seed, p + "down", (*experts, hidden, width),
                                 width ** -0.5 * residual_scale),
            )
            if experts:
                layer.router = self._randn(seed, p + "router", (experts[0], hidden), hidden ** -0.5)
            if s.architecture == "Qwen2ForCausalLM":
                layer.qkv_bias = self._randn(seed, p + "qkv_bias", ((H + 2 * KH) * D,), 0.1)
            if s.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or self.is_gemma3:
                layer.q_norm, layer.k_norm = ones(D), ones(D)
            if self.is_gemma3:
                layer.attn_out_norm, layer.mlp_out_norm = ones(hidden), ones(hidden)
            self.layers.append(layer)
        self.final_norm = ones(hidden)
        self.lm_head = self.embed if s.tie_word_embeddings else \
            self._randn(seed, "lm_head", (s.vocab_size, hidden), hidden ** -0.5)
        # Gemma 3's vision tower and projector: their bytes, allocated and never computed
        vision = s.params_by_part().get("vision", 0)
        self.vision = torch.empty(vision, device=self.device, dtype=self.dtype) if vision \
            else None

    def parameters(self):
        """Every weight tensor once (a tied LM head is the embedding)."""
        seen = {}
        tensors = [self.embed, self.final_norm, self.lm_head] \
            + ([self.vision] if self.vision is not None else [])
        for layer in self.layers:
            tensors += [t for t in vars(layer).values() if t is not None]
        for t in tensors:
            seen[id(t)] = t
        return list(seen.values())

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters())

    # -- caches -------------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """Zeroed caches [num_cache_slots, 2, num_blocks, block_size, num_kv_heads, head_dim]
        (a slot per layer unless `use_kv_groups` shares them)."""
        return torch.zeros((self.num_cache_slots, 2, num_blocks, block_size, self.num_kv_heads,
                            self.head_dim), device=self.device, dtype=self.dtype)

    # -- elementwise pieces -------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, weight: torch.Tensor, delta: Optional[torch.Tensor] = None):
        """(residual, normed): residual = x + delta (in place on the Triton path), RMSNorm'd."""
        if self.fused:
            out = torch.empty_like(x)
            if x.shape[0]:
                block = next_pow2(x.shape[1])
                add_rms_norm_kernel[(x.shape[0],)](
                    x, x if delta is None else delta, weight, out,
                    x.stride(0), (x if delta is None else delta).stride(0), out.stride(0),
                    x.shape[1], self.eps, HAS_DELTA=delta is not None, BLOCK=block,
                    num_warps=8 if block >= 2048 else 4)
            return x, out
        if delta is not None:
            x = x + delta
        return x, self._rms_norm_torch(x, weight)

    def _rms_norm_torch(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(compute)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * weight.to(compute)).to(x.dtype)

    def _rope(self, qk: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
        """Rotate q and k heads in place; qk [T, num_heads + num_kv_heads, head_dim] (a view)."""
        half = self.head_dim // 2
        if self.fused:
            if qk.shape[0]:
                rope_kernel[(qk.shape[0],)](
                    qk, positions, inv_freq, qk.stride(0), qk.shape[1],
                    HEADS_PAD=next_pow2(qk.shape[1]), HALF=half, HALF_PAD=next_pow2(half),
                    num_warps=4)
            return
        freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        x1 = qk[..., :half].to(inv_freq.dtype)
        x2 = qk[..., half:].to(inv_freq.dtype)
        out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        qk[..., :half] = out1.to(qk.dtype)
        qk[..., half:] = out2.to(qk.dtype)

    def _act_and_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of gu [T, 2 I] = [gate | up]: SiLU, or (Gemma 3) GELU's tanh form."""
        inter = gu.shape[1] // 2
        if self.fused:
            out = torch.empty((gu.shape[0], inter), device=gu.device, dtype=gu.dtype)
            if gu.shape[0]:
                block = min(2048, next_pow2(inter))
                act_and_mul_kernel[(gu.shape[0], triton.cdiv(inter, block))](
                    gu, out, gu.stride(0), out.stride(0), inter, BLOCK=block,
                    GELU_TANH=self.gelu, num_warps=4)
            return out
        gate = gu[:, :inter]
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return act * gu[:, inter:]

    def _feed_forward(self, layer: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """The dense gated MLP (SwiGLU; Gemma 3: GeGLU), or on a MoE layer the routed experts."""
        if layer.router is None:
            return F.linear(self._act_and_mul(F.linear(h, layer.gate_up)), layer.down)
        if self.fused:
            weights, ids = fused_route(h, layer.router, self.router_cfg)
            return fused_moe(h, layer.gate_up, layer.down, weights, ids)
        weights, ids = route(h, layer.router, self.router_cfg)
        return reference_moe(h, layer.gate_up, layer.down, weights, ids)

    # -- forward ------------------------------------------------------------------------------
    def _attention(self, i: int, layer: LayerWeights, h, positions, meta: AttentionMetadata,
                   caches) -> torch.Tensor:
        H, KH, D = self.num_heads, self.num_kv_heads, self.head_dim
        T = h.shape[0]
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)
        q = qkv[:, :H * D].view(T, H, D)
        k = qkv[:, H * D:(H + KH) * D].view(T, KH, D)
        v = qkv[:, (H + KH) * D:].view(T, KH, D)
        if layer.q_norm is not None and self.fused:
            if T:
                head_rms_norm_kernel[(T,)](qkv, layer.q_norm, layer.k_norm, qkv.stride(0), H, H + KH,
                                            self.eps, HEADS_PAD=next_pow2(H + KH), D=D, num_warps=4)
        elif layer.q_norm is not None:
            q.copy_(self._rms_norm_torch(q, layer.q_norm))
            k.copy_(self._rms_norm_torch(k, layer.k_norm))
        self._rope(qkv[:, :(H + KH) * D].view(T, H + KH, D), positions, self.layer_inv_freq[i])
        slot, window, scale = self.layer_slot[i], self.layer_windows[i], self.attn_scale
        k_cache, v_cache = caches[slot, 0], caches[slot, 1]
        tables = meta.groups[self.layer_group[i]] if meta.groups else meta   # this layer's group
        self.attn.write(k, v, k_cache, v_cache, tables.slot_mapping)
        out = torch.empty((T, H, D), device=h.device, dtype=h.dtype)
        P = meta.num_prefill_tokens
        if meta.fixed_shape:
            rows = meta.decode_seq_lens.shape[0]
            self.attn.decode(q[:rows], k_cache, v_cache, tables.decode_block_tables,
                             meta.decode_seq_lens, out[:rows], meta.decode_workspace,
                             window=window, scale=scale)
            self.attn.prefill(q, k_cache, v_cache, tables.prefill_block_tables,
                              meta.prefill_query_start_loc, meta.prefill_seq_lens, out,
                              window=window, scale=scale)
        elif P:
            self.attn.prefill(q[:P], k_cache, v_cache, tables.prefill_block_tables,
                              meta.prefill_query_start_loc, meta.prefill_seq_lens, out[:P],
                              window=window, scale=scale)
        if T > P and not meta.fixed_shape:
            self.attn.decode(q[P:], k_cache, v_cache, tables.decode_block_tables,
                             meta.decode_seq_lens, out[P:], meta.decode_workspace,
                             window=window, scale=scale)
        return self._reduce(F.linear(out.view(T, H * D), layer.o))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                caches: torch.Tensor, sample_rows: Optional[torch.Tensor] = None,
                check_finite: bool = False) -> torch.Tensor:
        """Logits [rows, vocab] (model dtype) of `sample_rows` (all rows when None).

        input_ids, positions int64 [T]; the step's K/V are written into `caches`. With
        `check_finite`, raises if any hidden state of the batch is NaN/inf (poisoning debug mode).
        """
        layers = self.layers
        x = self._embed(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        x, h = self._norm(x, layers[0].input_norm)
        for i, layer in enumerate(layers):
            a = self._attention(i, layer, h, positions, meta, caches)
            if layer.attn_out_norm is not None:
                a = self._norm(a, layer.attn_out_norm)[1]
            x, h = self._norm(x, layer.post_norm, a)
            m = self._reduce(self._feed_forward(layer, h))
            if layer.mlp_out_norm is not None:
                m = self._norm(m, layer.mlp_out_norm)[1]
            x, h = self._norm(x, layers[i + 1].input_norm if i + 1 < len(layers)
                              else self.final_norm, m)
        if check_finite and not bool(torch.isfinite(h).all()):
            raise FloatingPointError("non-finite hidden states: a forward read a freed, "
                                     "swapped-out or never-written KV slot")
        if sample_rows is not None:
            h = h.index_select(0, sample_rows)
        return self._logits(h)

    # -- where a tensor-parallel rank differs (simkv.gpu.tensor_parallel) ---------------------
    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's output: this rank's partial sum (one GPU: the whole)."""
        return partial

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head)
