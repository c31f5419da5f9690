"""What a checkpoint holds: every weight tensor of a decoder, and its bytes under a quantization.

A model's weights are listed as `Weight` groups (one tensor shape of one module, times the
layers and experts it appears in), tagged with the part of the model they belong to. Parameter
counts (total and active) and weight bytes are sums over that list, so a quantized format's
scales, zero points and group sizes are charged per matrix, as the checkpoint stores them.

Quantization (`Quantization`, from `quantization_config` or a `weights_dtype`):
- `fp8`: 1 byte per weight of every linear layer in the decoder, plus a float32 scale per
  tensor, or per `weight_block_size` block (DeepSeek-V3: 128 x 128).
- `awq` / `gptq`: `bits` per weight (4 or 8), per group of `group_size` input features a
  float16 scale and a packed zero point (gptq also an int32 group index per input feature).
- `mxfp4`: routed experts only (gpt-oss): 4 bits per weight and one E8M0 byte per 32.
Embeddings, the LM head, routers, norms and biases stay in the model dtype (2 bytes) under
every method, as vLLM loads them.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Optional

# Parts of a decoder. Routed experts are the ones a token uses only top_k of.
PARTS = ("embedding", "attention", "mlp", "router", "shared_expert", "expert", "norm", "lm_head",
         "vision")
LINEAR_PARTS = ("attention", "mlp", "shared_expert", "expert")   # quantizable matrices
MODEL_DTYPE_BYTES = 2            # bf16 (fp16 likewise); what vLLM serves unquantized weights in
MXFP4_BLOCK = 32                 # elements sharing one E8M0 scale byte (OCP MX format)
FP32_BYTES, FP16_BYTES, INT32_BYTES = 4, 2, 4


@dataclass(frozen=True)
class Weight:
    """`count` tensors of `rows x cols` elements (a linear layer: rows = output features, cols =
    input features; a vector: rows = 1) at HF module path `module` ('*' for layer and expert
    indices), in model part `part`."""

    module: str
    part: str
    rows: int
    cols: int
    count: int
    is_matrix: bool = True       # a linear layer's weight (biases, norms, sinks are not)

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.count


@dataclass(frozen=True)
class Quantization:
    """How a checkpoint stores its linear weights (see the module docstring for each method)."""

    method: str                          # fp8 | awq | gptq | mxfp4
    bits: int = 8
    group_size: Optional[int] = None     # awq/gptq: input features per scale (cols when None)
    block: Optional[tuple] = None        # fp8: (rows, cols) per float32 scale; None: per tensor
    zero_point: bool = True              # awq: packed zero points beside the scales
    skip: tuple = ()                     # module patterns left unquantized
    source: str = "quantization_config"  # or "weights_dtype"

    @property
    def weights_dtype(self) -> str:
        """A short name of what the quantized matrices hold: fp8, int4, int8, mxfp4."""
        if self.method in ("fp8", "mxfp4"):
            return self.method
        return f"int{self.bits}"

    @property
    def compute_dtype(self) -> str:
        """The tensor-core math the quantized layers run in: fp8 for fp8 weights (activations
        quantized on the fly, w8a8), bf16 for weight-only formats (dequantized in the kernel)."""
        return "fp8" if self.method == "fp8" else "bf16"

    def applies_to(self, w: Weight) -> bool:
        """Whether `w` is stored quantized."""
        if not w.is_matrix or w.part not in LINEAR_PARTS:
            return False
        if self.method == "mxfp4" and w.part != "expert":
            return False
        return not any(_matches(w.module, p) for p in self.skip)

    def matrix_bytes(self, rows: int, cols: int) -> int:
        """Bytes of one quantized `rows x cols` matrix with its scales (and zero points)."""
        if self.method == "fp8":
            if self.block is None:
                return rows * cols + FP32_BYTES
            b_rows, b_cols = self.block
            return rows * cols + FP32_BYTES * _cdiv(rows, b_rows) * _cdiv(cols, b_cols)
        if self.method == "mxfp4":
            return rows * cols // 2 + rows * _cdiv(cols, MXFP4_BLOCK)
        group = cols if not self.group_size or self.group_size < 0 else self.group_size
        groups = rows * _cdiv(cols, group)
        packed = rows * cols * self.bits // 8
        if self.method == "awq":
            zeros = groups * self.bits // 8 if self.zero_point else 0
            return packed + groups * FP16_BYTES + zeros
        # gptq: qweight, qzeros, fp16 scales, int32 g_idx per input feature
        return packed + groups * self.bits // 8 + groups * FP16_BYTES + cols * INT32_BYTES

    def describe(self) -> str:
        """One line: `fp8 (block 128x128 float32 scales, quantization_config)`."""
        if self.method == "fp8":
            scales = (f"block {self.block[0]}x{self.block[1]}" if self.block else "per-tensor") \
                + " float32 scales"
        elif self.method == "mxfp4":
            scales = f"experts only, one E8M0 scale per {MXFP4_BLOCK}"
        else:
            scales = f"{self.bits}-bit, group {self.group_size or 'per column'} fp16 scales"
        return f"{self.method} ({scales}; {self.source})"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _matches(module: str, pattern: str) -> bool:
    """HF and vLLM skip lists: a glob matching the module or a parent of it, or (no glob) a
    substring of its dotted path, as vLLM's `is_layer_skipped` checks."""
    if fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*"):
        return True
    return "*" not in pattern and pattern in module


def tensor_bytes(w: Weight, quant: Optional[Quantization]) -> int:
    """Bytes the checkpoint holds for `w` (all `count` copies)."""
    if quant is not None and quant.applies_to(w):
        return quant.matrix_bytes(w.rows, w.cols) * w.count
    return w.params * MODEL_DTYPE_BYTES


@dataclass(frozen=True)
class Experts:
    """The routed-expert structure of a mixture-of-experts model."""

    num_experts: int             # routed experts per MoE layer
    top_k: int                   # routed experts each token uses
    num_shared_experts: int      # experts every token uses (DeepSeek), beside the routed ones
    expert_intermediate_size: int
    num_moe_layers: int
    moe_layers: tuple = field(default=(), compare=False)   # their indices


@dataclass(frozen=True)
class LinearAttention:
    """A Gated DeltaNet layer's dimensions (Qwen3-Next's linear attention): the state it keeps per
    sequence is a causal-convolution window over its q/k/v projections and a recurrent
    key-by-value matrix per value head."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q and k (key_dim each) and v (value_dim)."""
        return 2 * self.key_dim + self.value_dim

    def state_elements(self) -> tuple:
        """(convolution state, recurrent state) elements one sequence keeps per layer: the last
        conv_kernel_size - 1 inputs of every channel, and value heads x key dim x value dim
        (vLLM's MambaStateShapeCalculator.gated_delta_net_state_shape, tensor parallel size 1)."""
        return (self.conv_dim * (self.conv_kernel_size - 1),
                self.num_value_heads * self.key_head_dim * self.value_head_dim)


@dataclass(frozen=True)
class Vision:
    """A SigLIP vision tower and the projector into the text model (Gemma 3)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    patch_size: int
    image_size: int
    num_channels: int = 3


def layout(arch: str, c: "Shape") -> list:
    """Every weight of a model of architecture `arch` with the shape `c`, as Weight groups."""
    out: list = [Weight("model.embed_tokens", "embedding", c.vocab_size, c.hidden_size, 1)]
    out += _attention(arch, c)
    if c.linear is not None:
        out += _linear_attention(c)
    out += _feed_forward(arch, c)
    L, H = c.num_layers, c.hidden_size
    # Gemma 3 normalises before and after both attention and the MLP
    norms = 4 if arch.startswith("Gemma3") else 2
    out.append(Weight("model.layers.*.norms", "norm", 1, norms * H, L, is_matrix=False))
    out.append(Weight("model.norm", "norm", 1, H, 1, is_matrix=False))
    if not c.tie_word_embeddings:
        out.append(Weight("lm_head", "lm_head", c.vocab_size, H, 1))
    if c.vision is not None:
        out += _vision(c.vision, H)
    return out


def _vision(v: Vision, text_hidden: int) -> list:
    """A SigLIP encoder (patch and position embeddings, pre-norm layers of attention with biases
    and a two-matrix MLP, a final norm) and Gemma 3's projector (a norm and one matrix)."""
    p, h, i, n = "vision_tower.", v.hidden_size, v.intermediate_size, v.num_layers
    patches = (v.image_size // v.patch_size) ** 2
    return [
        Weight(p + "patch_embedding", "vision", h, v.num_channels * v.patch_size ** 2 + 1, 1),
        Weight(p + "position_embedding", "vision", patches, h, 1, is_matrix=False),
        Weight(p + "layers.*.attn", "vision", 4 * h, h + 1, n),
        Weight(p + "layers.*.mlp.fc1", "vision", i, h + 1, n),
        Weight(p + "layers.*.mlp.fc2", "vision", h, i + 1, n),
        Weight(p + "layers.*.layer_norms", "vision", 1, 4 * h, n, is_matrix=False),
        Weight(p + "post_layernorm", "vision", 1, 2 * h, 1, is_matrix=False),
        Weight("multi_modal_projector.mm_soft_emb_norm", "vision", 1, h, 1, is_matrix=False),
        Weight("multi_modal_projector.mm_input_projection", "vision", h, text_hidden, 1),
    ]


def _linear_attention(c: "Shape") -> list:
    """Gated DeltaNet layers (Qwen3-Next): q/k/v/z and b/a projections, a depthwise convolution,
    per-head decay and step parameters, a gated norm and the output projection."""
    g, H, n = c.linear, c.hidden_size, c.num_layers - c.num_attention_layers
    p = "model.layers.*.linear_attn."
    return [
        Weight(p + "in_proj_qkvz", "attention", 2 * g.key_dim + 2 * g.value_dim, H, n),
        Weight(p + "in_proj_ba", "attention", 2 * g.num_value_heads, H, n),
        Weight(p + "conv1d", "attention", g.conv_dim, g.conv_kernel_size, n, is_matrix=False),
        Weight(p + "dt_bias+A_log", "attention", 1, 2 * g.num_value_heads, n, is_matrix=False),
        Weight(p + "norm", "norm", 1, g.value_head_dim, n, is_matrix=False),
        Weight(p + "out_proj", "attention", H, g.value_dim, n),
    ]


@dataclass(frozen=True)
class Shape:
    """The dimensions `layout` needs (filled from config.json by simkv.specs)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    experts: Optional[Experts] = None
    # hybrids: the layers with softmax attention (the rest are linear attention)
    attention_layers: Optional[int] = None
    linear: Optional[LinearAttention] = None
    attn_output_gate: bool = False           # Qwen3-Next: q_proj also gives a gate per head
    vision: Optional[Vision] = None
    shared_expert_gate: bool = False         # Qwen3-Next: a sigmoid gate on the shared expert
    # MLA (DeepSeek-V2, V3)
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None

    @property
    def num_attention_layers(self) -> int:
        return self.num_layers if self.attention_layers is None else self.attention_layers


def _attention(arch: str, c: Shape) -> list:
    L, H = c.num_attention_layers, c.hidden_size
    p = "model.layers.*.self_attn."
    if c.kv_lora_rank is not None:                       # MLA
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        out = []
        if c.q_lora_rank:
            out += [Weight(p + "q_a_proj", "attention", c.q_lora_rank, H, L),
                    Weight(p + "q_a_layernorm", "norm", 1, c.q_lora_rank, L, is_matrix=False),
                    Weight(p + "q_b_proj", "attention", c.num_heads * qk, c.q_lora_rank, L)]
        else:
            out.append(Weight(p + "q_proj", "attention", c.num_heads * qk, H, L))
        return out + [
            Weight(p + "kv_a_proj_with_mqa", "attention", c.kv_lora_rank + c.qk_rope_head_dim,
                   H, L),
            Weight(p + "kv_a_layernorm", "norm", 1, c.kv_lora_rank, L, is_matrix=False),
            Weight(p + "kv_b_proj", "attention",
                   c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, L),
            Weight(p + "o_proj", "attention", H, c.num_heads * c.v_head_dim, L),
        ]
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    gate = 2 if c.attn_output_gate else 1
    out = [Weight(p + "q_proj", "attention", gate * q_out, H, L),
           Weight(p + "k_proj", "attention", kv_out, H, L),
           Weight(p + "v_proj", "attention", kv_out, H, L),
           Weight(p + "o_proj", "attention", H, q_out, L)]
    qkv_bias = arch == "Qwen2ForCausalLM" or c.attention_bias
    if qkv_bias:
        out.append(Weight(p + "qkv.bias", "attention", 1, q_out + 2 * kv_out, L, is_matrix=False))
    if c.attention_bias:
        out.append(Weight(p + "o_proj.bias", "attention", 1, H, L, is_matrix=False))
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM") \
            or arch.startswith("Gemma3"):
        out.append(Weight(p + "q_norm+k_norm", "norm", 1, 2 * c.head_dim, L, is_matrix=False))
    if arch == "GptOssForCausalLM":
        out.append(Weight(p + "sinks", "attention", 1, c.num_heads, L, is_matrix=False))
    return out


def _dense_mlp(c: Shape, layers: int) -> list:
    if not layers:
        return []
    p, H, I = "model.layers.*.mlp.", c.hidden_size, c.intermediate_size
    out = [Weight(p + "gate_proj", "mlp", I, H, layers),
           Weight(p + "up_proj", "mlp", I, H, layers),
           Weight(p + "down_proj", "mlp", H, I, layers)]
    if c.mlp_bias:
        out.append(Weight(p + "bias", "mlp", 1, 2 * I + H, layers, is_matrix=False))
    return out


def _feed_forward(arch: str, c: Shape) -> list:
    e = c.experts
    if e is None:
        return _dense_mlp(c, c.num_layers)
    H, I, n = c.hidden_size, e.expert_intermediate_size, e.num_moe_layers
    out = _dense_mlp(c, c.num_layers - n)
    count = e.num_experts * n
    if arch == "MixtralForCausalLM":
        p = "model.layers.*.block_sparse_moe."
        out += [Weight(p + "gate", "router", e.num_experts, H, n),
                Weight(p + "experts.*.w1", "expert", I, H, count),
                Weight(p + "experts.*.w3", "expert", I, H, count),
                Weight(p + "experts.*.w2", "expert", H, I, count)]
    elif arch == "GptOssForCausalLM":
        p = "model.layers.*.mlp."
        out += [Weight(p + "router", "router", e.num_experts, H, n),
                Weight(p + "router.bias", "router", 1, e.num_experts, n, is_matrix=False),
                Weight(p + "experts.gate_up_proj", "expert", 2 * I, H, count),
                Weight(p + "experts.gate_up_proj_bias", "expert", 1, 2 * I, count,
                       is_matrix=False),
                Weight(p + "experts.down_proj", "expert", H, I, count),
                Weight(p + "experts.down_proj_bias", "expert", 1, H, count, is_matrix=False)]
    else:                                       # Qwen3-MoE, Qwen3-Next, DeepSeek-V2/V3
        p = "model.layers.*.mlp."
        out += [Weight(p + "gate", "router", e.num_experts, H, n),
                Weight(p + "experts.*.gate_proj", "expert", I, H, count),
                Weight(p + "experts.*.up_proj", "expert", I, H, count),
                Weight(p + "experts.*.down_proj", "expert", H, I, count)]
        if arch == "DeepseekV3ForCausalLM":
            out.append(Weight(p + "gate.e_score_correction_bias", "router", 1, e.num_experts, n,
                              is_matrix=False))
        if e.num_shared_experts:
            shared = I * e.num_shared_experts          # one MLP of n_shared x the expert width
            out += [Weight(p + "shared_experts.gate_proj", "shared_expert", shared, H, n),
                    Weight(p + "shared_experts.up_proj", "shared_expert", shared, H, n),
                    Weight(p + "shared_experts.down_proj", "shared_expert", H, shared, n)]
        if c.shared_expert_gate:
            out.append(Weight(p + "shared_expert_gate", "router", 1, H, n))
    return out
