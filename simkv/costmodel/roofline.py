"""Roofline step-cost model: from model and GPU specs, with efficiency factors.

A step reads the weights once, reads every scheduled sequence's KV, writes the new tokens' KV,
and does 2 FLOPs per parameter per token plus the attention's query-key work. Linear layers cost
the larger of their weight-read time and their FLOP time; attention is memory-bound for decodes
and FLOP-bound for long prefills. A fixed per-step and per-sequence host overhead is added.

A mixture-of-experts model's routed experts are a term of their own (`experts`): the step reads
the experts its tokens are routed to, in expectation (simkv.costmodel.features.moe_step: uniform
routing, or skewed by `expert_skew`), and does the FLOPs of top_k experts per token; the larger
of the two is the term, and everything else (attention, shared experts, routers, embeddings,
the LM head) stays in `linear`. Weights are the checkpoint's bytes (a quantized checkpoint reads
less); fp8 weights run at the GPU's fp8 rate (activations quantized on the fly), weight-only
formats (int4, mxfp4) at the bf16 rate. All experts are on the one GPU (no expert parallelism).
Attention by layer kind (`grouped_attention`, for models with window or linear-attention
layers): a full layer reads its whole context, a window layer at most window - 1 tokens before
a query, a linear-attention layer reads and writes a constant state per sequence and does its
recurrence per token. An MLA decode reads one latent per token and layer and attends in the
latent (the absorbed form), so its KV term is the larger of that read and those FLOPs.
The efficiency factors are calibrated on a profiled GPU (see `simkv fit`); until then they are
defaults, and every result that uses this model says it is an estimate.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

from simkv.costmodel.features import moe_step
from simkv.costmodel.step_cost import TermModel


@dataclass
class RooflineParams:
    bandwidth_efficiency: float = 0.85    # device copy measured 4.22 of 4.8 TB/s on the H200
    flops_efficiency: float = 0.60        # dense bf16 GEMMs at serving shapes
    attention_flops_efficiency: float = 0.40
    step_overhead_s: float = 250e-6       # host work + launches per step
    per_seq_overhead_s: float = 2e-6      # host-side metadata per scheduled sequence
    host_link_efficiency: float = 0.80
    # The calibrated form: a decode-only step of at most `graph_max_batch` sequences replays a
    # CUDA graph; any other step (prefill chunks: more kernels per layer, and above the largest
    # mixed-step graph launched from the host) costs the "eager" overhead. Both are a fixed
    # overhead per layer (the kernels' launch gaps and tails; a model with half the layers runs
    # half the kernels; counting graphed mixed steps as graphed fitted worse: docs/profiling.md).
    # When these are set they replace step_overhead_s.
    graph_overhead_s_per_layer: Optional[float] = None
    eager_overhead_s_per_layer: Optional[float] = None
    graph_max_batch: int = 256
    # Mixture of experts: the router's imbalance, a Zipf exponent over expert popularity
    # (0 = uniform routing; simkv.costmodel.features.expert_inclusion_probabilities).
    expert_skew: float = 0.0


def load_calibration(gpu_name: str, profiles: Path) -> Optional[dict]:
    """The roofline calibration measured on `gpu_name`, else on any profiled GPU (the factors are
    efficiencies, so they carry over as an estimate): {"params", "note"} or None."""
    candidates = [profiles / gpu_name / "roofline_calibration.json"]
    candidates += sorted(p for p in profiles.glob("*/roofline_calibration.json")
                         if p not in candidates)
    for path in candidates:
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
            chosen = data.get("proposed") or data
            known = {f.name for f in fields(RooflineParams)}
            params = RooflineParams(**{k: v for k, v in chosen["params"].items() if k in known})
        except (ValueError, KeyError, TypeError, AttributeError):
            continue        # a corrupt calibration is ignored: the defaults remain
        errors = ", ".join(f"{model}: median {e['median']:.1%}, p95 {e['p95']:.1%}"
                           for model, e in (chosen.get("error") or {}).items())
        note = (f"roofline estimate, efficiencies calibrated on {path.parent.name}/"
                f"{data.get('calibrated_on', '?')}; error predicting another profiled model's "
                f"step times: {errors or 'not measured'}")
        return {"params": params, "note": note, "path": str(path)}
    return None


def window_pairs(start: int, n: int, window: int) -> int:
    """Query-key pairs of n queries at positions start..start+n-1, each attending to itself and
    the window - 1 tokens before it (at most): sum of min(p + 1, window)."""
    lo, hi = start + 1, start + n            # each query's keys, unbounded: lo..hi
    if hi <= window:
        return (lo + hi) * n // 2
    if lo > window:
        return n * window
    return (lo + window) * (window - lo + 1) // 2 + (hi - window) * window


def linear_attention_flops(model) -> float:
    """FLOPs per token of one linear-attention layer's recurrence (the projections are in the
    parameters): per value head, the delta-rule update of its key x value state (decay, read,
    rank-one write) and the output read, about 4 multiply-adds per state element."""
    g = model.linear_attention
    if g is None:
        return 0.0
    return 8.0 * g.num_value_heads * g.key_head_dim * g.value_head_dim


class RooflineCostModel(TermModel):
    """`predict(plan) -> seconds` from specs, as named terms; `name` is reported in every
    result."""

    term_names = ("linear", "kv_read_write", "prefill_attention", "step_overhead",
                  "per_sequence", "block_copies", "swap")

    name = "roofline"
    is_estimate = True
    note = "roofline estimate from specs with default efficiencies (no calibration found)"

    def __init__(self, model, gpu, kv_dtype: str = "bf16", block_size: int = 16,
                 params: RooflineParams | None = None):
        self.params = params or RooflineParams()
        p = self.params
        self.model = model
        self.block_size = block_size
        self.kv_bytes_per_token = model.kv_bytes_per_token(kv_dtype)
        self.bytes_per_block = self.kv_bytes_per_token * block_size
        self.weight_bytes = model.weight_bytes()
        # Every layer but the embedding table runs on every token; the LM head only on rows that
        # sample a token.
        self.flops_per_token, self.flops_per_sample, self.attn_flops_per_pair = \
            model.forward_flops()
        self.num_layers = model.num_layers
        self.is_moe = model.experts is not None
        if self.is_moe:       # the routed experts leave `linear` for a term of their own
            self.term_names = self.term_names[:1] + ("experts",) + self.term_names[1:]
            self.weight_bytes -= model.routed_expert_bytes()
            e = model.experts
            self.flops_per_token -= 2.0 * e.top_k * model.expert_params * e.num_moe_layers
        bw = gpu.hbm_bandwidth_bytes_per_s * p.bandwidth_efficiency
        self.seconds_per_byte = 1.0 / bw
        compute = model.quantization.compute_dtype if model.quantization else "bf16"
        self.seconds_per_flop = 1.0 / (gpu.flops_per_s(compute) * p.flops_efficiency)
        self.seconds_per_attn_flop = 1.0 / (gpu.bf16_flops_per_s * p.attention_flops_efficiency)
        self.seconds_per_host_byte = 1.0 / (gpu.host_link_bytes_per_s * p.host_link_efficiency)
        # Attention by kind of layer (simkv.kv_geometry): None for a model whose layers all
        # keep full KV, which pays nothing more per step
        types = model.attention_types
        self.layer_counts = None
        if "sliding_attention" in types or "linear_attention" in types:
            self.layer_counts = tuple(sum(1 for t in types if t == kind) for kind in (
                "full_attention", "sliding_attention", "linear_attention"))
            self.window = model.sliding_window or 0
            self.linear_state_bytes = model.linear_state_bytes()
            self.linear_flops_per_token = linear_attention_flops(model)
        # MLA decodes attend in the latent (the absorbed form vLLM's MLA backends run): per
        # query-key pair and layer, 2 x heads x (latent + rope) FLOPs for the scores and
        # 2 x heads x latent for the values, against one latent read per token and layer
        # (as a multiple of the prefill's per-pair FLOPs, 2 x heads x (qk + v): a tensor-parallel
        # rank's share of the heads follows)
        self.mla_absorbed_ratio = 0.0
        if model.kv_lora_rank is not None:
            self.mla_absorbed_ratio = (2 * model.kv_lora_rank + model.qk_rope_head_dim) \
                / (model.qk_head_dim + model.v_head_dim)

    def term_values(self, plan) -> tuple:
        """Seconds of one step's terms (TERMS): linear layers (weight read or FLOPs, whichever is
        longer), KV reads and writes, prefill attention, the step's overhead (graphed or eager),
        per sequence, block copies, swaps."""
        tokens = plan.num_prefill_tokens + plan.num_decode_tokens
        p = self.params
        linear = kv = attention = overhead = per_seq = 0.0
        if tokens:
            sampled = plan.num_decode_tokens + plan.num_prefill_seqs
            flops = self.flops_per_token * tokens + self.flops_per_sample * sampled
            linear = max(self.weight_bytes * self.seconds_per_byte, flops * self.seconds_per_flop)
            if self.layer_counts is None:
                kv_read = plan.decode_context_tokens + plan.prefill_context_tokens
                kv = (kv_read + tokens) * self.kv_bytes_per_token * self.seconds_per_byte
                attention = plan.prefill_attention_pairs * self.attn_flops_per_pair \
                    * self.seconds_per_attn_flop
            else:
                kv, attention = self.grouped_attention(plan, tokens)
            if self.mla_absorbed_ratio:
                kv = max(kv, plan.decode_context_tokens * self.attn_flops_per_pair
                         * self.mla_absorbed_ratio * self.seconds_per_attn_flop)
            if p.eager_overhead_s_per_layer is None:
                overhead = p.step_overhead_s
            elif plan.num_prefill_tokens == 0 and plan.num_decode_tokens <= p.graph_max_batch:
                overhead = (p.graph_overhead_s_per_layer or 0.0) * self.num_layers
            else:
                overhead = p.eager_overhead_s_per_layer * self.num_layers
            per_seq = p.per_seq_overhead_s * len(plan.scheduled)
        copies = 2 * len(plan.block_copies) * self.bytes_per_block * self.seconds_per_byte \
            if plan.block_copies else 0.0
        swapped = len(plan.swap_out) + len(plan.swap_in)
        swaps = swapped * self.bytes_per_block * self.seconds_per_host_byte if swapped else 0.0
        if not self.is_moe:
            return (linear, kv, attention, overhead, per_seq, copies, swaps)
        experts = 0.0
        if tokens:
            moe = self.moe(plan)
            experts = max(moe.expert_bytes_read * self.seconds_per_byte,
                          moe.expert_flops * self.seconds_per_flop)
        return (linear, experts, kv, attention, overhead, per_seq, copies, swaps)

    def grouped_attention(self, plan, tokens: int) -> tuple:
        """(KV read/write seconds, prefill attention seconds) of a model with window or
        linear-attention layers: a full layer reads every context token, a window layer at
        most its window (a chunk: window - 1 before its first query, plus the chunk), a
        linear-attention layer reads and writes its state once per scheduled sequence and
        does its recurrence per token; prefill pairs per layer kind."""
        full, sliding, linear = self.layer_counts
        per_layer = self.kv_bytes_per_token / (full + sliding)
        pair_flops = self.attn_flops_per_pair / (full + sliding)
        w = self.window
        full_read = sliding_read = full_pairs = sliding_pairs = 0
        for item in plan.scheduled:
            s, n = item.start, item.num_tokens
            full_read += s + n
            sliding_read += min(s + n, w - 1 + n)
            if not item.is_decode:
                full_pairs += n * s + n * (n + 1) // 2
                sliding_pairs += window_pairs(s, n, w)
        read = (full * full_read + sliding * sliding_read + (full + sliding) * tokens) \
            * per_layer + 2 * linear * self.linear_state_bytes * len(plan.scheduled)
        flops = (full * full_pairs + sliding * sliding_pairs) * pair_flops \
            + linear * self.linear_flops_per_token * tokens
        return read * self.seconds_per_byte, flops * self.seconds_per_attn_flop

    def moe(self, plan):
        """The step's MoE features (simkv.costmodel.features.MoeStep) at this model's skew."""
        return moe_step(plan, self.model, self.params.expert_skew)

    def describe(self) -> dict:
        return {"name": self.name, "estimate": True, "note": self.note,
                "params": asdict(self.params)}
