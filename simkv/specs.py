"""Model and GPU specs: what the sizing arithmetic and the cost models know about the hardware.

Models are HF-style `config.json` files (bundled under `profiles/models/` or any path); GPUs come
from `profiles/gpus.yaml`. Both are input boundaries, so every problem raises InputError naming the
file and the field.
"""
from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional


from simkv.errors import InputError, read_json_object, read_yaml_mapping
from simkv.limits import RULES
from simkv.weights import (Experts, LinearAttention, Quantization, Shape, Vision, layout,
                           tensor_bytes)

DENSE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
)
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen3NextForCausalLM",
)
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# `model_type` values simkv knows (a config whose model_type is another is refused: its layers
# may keep KV in a way simkv would size wrongly)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_text", "mixtral",
               "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3", "qwen3_next")
# `layer_types` entries: what each decoder layer keeps per sequence
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
# `quantization_config.quant_method` values simkv sizes (simkv.weights says how each stores)
QUANT_METHODS = ("fp8", "awq", "gptq", "mxfp4")
# `weights_dtype` overrides: what the linear weights are served as
WEIGHTS_DTYPES = ("bf16", "fp8", "int4", "mxfp4")
# Gemma 3's `hidden_activation` values the sample model computes (transformers' ACT2FN names)
HIDDEN_ACTIVATIONS = ("gelu_pytorch_tanh", "silu")
# Gemma 3's defaults where its config leaves a key out (transformers' Gemma3TextConfig)
GEMMA3_DEFAULTS = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                   "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh"}

# Bytes per element of a KV cache entry.
KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1}
# vLLM's --kv-cache-dtype names for the same caches: auto is the model's dtype (bf16 for the
# bundled models), fp8's two formats move the same bytes
KV_DTYPE_ALIASES = {"auto": "bf16", "bfloat16": "bf16", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def kv_dtype_name(name: str) -> str:
    """simkv's name (bf16, fp8) for a KV cache dtype given by it or by vLLM's name."""
    return KV_DTYPE_ALIASES.get(name, name)


def profiles_dir() -> Path:
    """The `profiles/` folder: `$SIMKV_PROFILES` if set, else `<repo root>/profiles`."""
    override = os.environ.get("SIMKV_PROFILES")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "profiles"


def closest_name(text: str, names: list[str]) -> Optional[str]:
    """The name `text` most likely meant: one it is a prefix of, else the closest spelling."""
    prefixed = [n for n in names if n.startswith(text)]
    if prefixed:
        return min(prefixed, key=len)
    close = difflib.get_close_matches(text, names, n=1)
    return close[0] if close else None


# ----------------------------------------------------------------------------------------------
# Models


@dataclass
class ModelSpec:
    """A decoder-only transformer (dense or mixture-of-experts), as far as memory and compute
    are concerned. `weights` lists every tensor the checkpoint holds (simkv.weights)."""

    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int               # the dense MLP's (Mixtral, gpt-oss: each expert's)
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: Optional[dict]
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_params: int
    torch_dtype: str
    path: Optional[Path] = None             # the config.json it was loaded from
    weights: tuple = ()                     # simkv.weights.Weight groups
    experts: Optional[Experts] = None       # None: a dense model
    quantization: Optional[Quantization] = None
    kv_lora_rank: Optional[int] = None      # MLA: one latent of kv_lora_rank + qk_rope_head_dim
    qk_rope_head_dim: Optional[int] = None  #      elements per token and layer is the KV cache
    qk_head_dim: Optional[int] = None       # per-head query-key width (head_dim unless MLA)
    v_head_dim: Optional[int] = None        # per-head value width (head_dim unless MLA)
    layer_types: Optional[tuple] = None     # config's `layer_types`, as given
    sliding_window: Optional[int] = None    # tokens a sliding_attention layer attends to
    # what each layer keeps per sequence (LAYER_TYPES), from layer_types or the family's rule
    attention_types: tuple = ()
    linear_attention: Optional[LinearAttention] = None   # linear_attention layers' dimensions
    model_type: Optional[str] = None
    # Gemma 3 (None elsewhere): attention scores scaled by query_pre_attn_scalar ** -0.5 (not
    # head_dim ** -0.5); sliding layers' RoPE base, unscaled (full layers: rope_theta and
    # rope_scaling); the gated MLP's activation (elsewhere SiLU)
    query_pre_attn_scalar: Optional[float] = None
    rope_local_base_freq: Optional[float] = None
    hidden_activation: Optional[str] = None

    # --- KV ------------------------------------------------------------------------------
    @property
    def num_attention_layers(self) -> int:
        """Layers with softmax attention (full or sliding window): those that keep KV per token."""
        return sum(1 for t in self.attention_types if t != "linear_attention")

    def kv_bytes_per_layer_token(self, kv_dtype: str = "bf16") -> int:
        """Bytes one token occupies in one attention layer: K and V of every KV head (MLA: the
        one compressed latent, as vLLM stores it)."""
        if self.kv_lora_rank is not None:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * KV_DTYPE_BYTES[kv_dtype]
        return 2 * self.num_kv_heads * self.head_dim * KV_DTYPE_BYTES[kv_dtype]

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """Bytes of KV cache one token occupies summed over the attention layers (a sliding-window
        layer holds it while the token is in its window; linear-attention layers keep a state
        per sequence instead, `linear_state_bytes`)."""
        return self.num_attention_layers * self.kv_bytes_per_layer_token(kv_dtype)

    def linear_state_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of state one sequence keeps in one linear-attention layer (0 when none): the
        convolution window and the recurrent matrix, both in the model dtype (vLLM's default
        mamba_ssm_cache_dtype 'auto')."""
        if self.linear_attention is None:
            return 0
        return sum(self.linear_attention.state_elements()) * dtype_bytes

    @property
    def is_hybrid(self) -> bool:
        """Whether layers keep KV in more than one way (vLLM: more than one KV cache group)."""
        return len(set(self.attention_types)) > 1

    # --- parameters ----------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.experts is not None

    def params_by_part(self) -> dict:
        """Parameters per model part (simkv.weights.PARTS), parts the model lacks left out."""
        out: dict = {}
        for w in self.weights:
            out[w.part] = out.get(w.part, 0) + w.params
        return out

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert of one layer (weights and biases); 0 when dense."""
        if self.experts is None:
            return 0
        e = self.experts
        return self.params_by_part()["expert"] // (e.num_experts * e.num_moe_layers)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: all but the routed experts it is not sent to (the
        embedding table and the LM head included)."""
        if self.experts is None:
            return self.num_params
        e = self.experts
        return self.num_params - (e.num_experts - e.top_k) * e.num_moe_layers * self.expert_params

    # --- bytes ---------------------------------------------------------------------------
    @property
    def weights_dtype(self) -> str:
        """What the linear weights are stored as: bf16, fp8, int4, int8 or mxfp4 (experts)."""
        return self.quantization.weights_dtype if self.quantization else "bf16"

    def weight_bytes(self, dtype_bytes: Optional[int] = None) -> int:
        """Bytes of all weights as the checkpoint holds them (quantized matrices with their
        scales); with `dtype_bytes`, every parameter at that many bytes instead."""
        if dtype_bytes is not None:
            return self.num_params * dtype_bytes
        return sum(tensor_bytes(w, self.quantization) for w in self.weights)

    def routed_expert_bytes(self) -> int:
        """Bytes of every routed expert of every MoE layer (0 when dense)."""
        return sum(tensor_bytes(w, self.quantization) for w in self.weights
                   if w.part == "expert")

    @property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert of one layer (0 when dense)."""
        if self.experts is None:
            return 0
        return self.routed_expert_bytes() // (self.experts.num_experts
                                              * self.experts.num_moe_layers)

    def forward_flops(self) -> tuple:
        """(FLOPs per token of every layer but the embedding table and the LM head, per sampled
        row of the LM head, per query-key pair of attention) of one forward pass. A token runs
        its active parameters: the routed experts it is sent to, not all of them."""
        embed = self.vocab_size * self.hidden_size
        dense = self.active_params - embed * (1 if self.tie_word_embeddings else 2)
        qk = self.qk_head_dim or self.head_dim
        v = self.v_head_dim or self.head_dim
        return 2.0 * dense, 2.0 * embed, 2.0 * self.num_attention_layers * self.num_heads * (qk + v)


def count_params(architecture: str, shape: Shape) -> int:
    """Parameters (count, not bytes) of a decoder of `architecture` with dimensions `shape`:
    the sum over simkv.weights.layout."""
    return sum(w.params for w in layout(architecture, shape))


# ----------------------------------------------------------------------------------------------
# config.json fields, type-checked where they are read (every message names the file and key)

_MISSING = object()


def _value(config: dict, key: str, path: Path, default):
    if key not in config or config[key] is None:
        if default is _MISSING:
            raise InputError(f"{path}: missing required field '{key}'")
        return default
    return config[key]


def _int(config: dict, key: str, path: Path, default=_MISSING, minimum: int = 1):
    """An integral field >= minimum (a JSON integer, or a float with no fraction: 8.0)."""
    if default is not _MISSING and config.get(key) is None:
        return default
    value = _value(config, key, path, _MISSING)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
            or RULES["model.int"].problem(value):
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise InputError(f"{path}: field '{key}' must be {kind}, got {value!r}"
                         + _at_most(value, RULES["model.int"].high))
    return value


def _at_most(value: Any, high: float) -> str:
    """' (at most HIGH)' when a number is refused for being above the rule's bound."""
    too_big = isinstance(value, (int, float)) and not isinstance(value, bool) and value > high
    return f" (at most {high:,})" if too_big else ""


def _number(config: dict, key: str, path: Path, default: float) -> float:
    """A finite positive number."""
    value = _value(config, key, path, default)
    if RULES["model.number"].problem(value):
        raise InputError(f"{path}: field '{key}' must be a positive number, got {value!r}"
                         + _at_most(value, RULES["model.number"].high))
    return float(value)


def _bool(config: dict, key: str, path: Path, default: bool) -> bool:
    value = _value(config, key, path, default)
    if not isinstance(value, bool):
        raise InputError(f"{path}: field '{key}' must be true or false, got {value!r}")
    return value


def _choice(config: dict, key: str, path: Path, default: str, choices: tuple) -> str:
    value = _value(config, key, path, default)
    if value not in choices:
        raise InputError(f"{path}: field '{key}' must be one of {', '.join(choices)}, "
                         f"got {value!r}")
    return value


def _gemma3(config: dict, path) -> dict:
    """Gemma 3's own fields (ModelSpec's query_pre_attn_scalar, rope_local_base_freq,
    hidden_activation), transformers' defaults where absent."""
    d = GEMMA3_DEFAULTS
    return {"query_pre_attn_scalar": _number(config, "query_pre_attn_scalar", path,
                                             d["query_pre_attn_scalar"]),
            "rope_local_base_freq": _number(config, "rope_local_base_freq", path,
                                            d["rope_local_base_freq"]),
            "hidden_activation": _choice(config, "hidden_activation", path,
                                         d["hidden_activation"], HIDDEN_ACTIVATIONS)}


def _strings(config: dict, key: str, path: Path) -> tuple:
    value = _value(config, key, path, [])
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise InputError(f"{path}: field '{key}' must be a list of strings, got {value!r}")
    return tuple(value)


def _experts(architecture: str, config: dict, path: Path, num_layers: int,
             intermediate_size: int) -> Experts:
    """The routed experts of a MoE config, by each family's key names."""
    shared, layers = 0, range(num_layers)
    if architecture in ("MixtralForCausalLM", "GptOssForCausalLM"):
        num_experts = _int(config, "num_local_experts", path)
        width = intermediate_size
    elif architecture in ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"):
        num_experts = _int(config, "num_experts", path)
        width = _int(config, "moe_intermediate_size", path)
        if architecture == "Qwen3NextForCausalLM":
            # one shared expert per layer, of its own width (a whole number of expert widths)
            shared_width = _int(config, "shared_expert_intermediate_size", path)
            if shared_width % width:
                raise InputError(f"{path}: field 'shared_expert_intermediate_size' "
                                 f"({shared_width}) is not a multiple of moe_intermediate_size "
                                 f"({width})")
            shared = shared_width // width
        step = _int(config, "decoder_sparse_step", path, 1)
        dense = config.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers
                for i in dense):
            raise InputError(f"{path}: field 'mlp_only_layers' must be a list of layer indices "
                             f"in [0, {num_layers}), got {dense!r}")
        layers = [i for i in layers if i not in dense and (i + 1) % step == 0]
    else:                                                   # DeepSeek-V2, V3
        num_experts = _int(config, "n_routed_experts", path)
        width = _int(config, "moe_intermediate_size", path)
        shared = _int(config, "n_shared_experts", path, 0, minimum=0)
        first_dense = _int(config, "first_k_dense_replace", path, 0, minimum=0)
        freq = _int(config, "moe_layer_freq", path, 1)
        if first_dense > num_layers:
            raise InputError(f"{path}: field 'first_k_dense_replace' ({first_dense}) is more "
                             f"than num_hidden_layers ({num_layers})")
        layers = [i for i in layers if i >= first_dense and i % freq == 0]
    top_k = _int(config, "num_experts_per_tok", path)
    if top_k > num_experts:
        raise InputError(f"{path}: field 'num_experts_per_tok' ({top_k}) is more than the "
                         f"{num_experts} routed experts")
    if not layers:
        raise InputError(f"{path}: no layer is a mixture-of-experts layer (check "
                         "first_k_dense_replace / mlp_only_layers / decoder_sparse_step)")
    return Experts(num_experts, top_k, shared, width, len(layers), tuple(layers))


def _attention_types(architecture: str, config: dict, path, num_layers: int) -> tuple:
    """(what each layer keeps per sequence, the sliding window or None): `layer_types` when the
    config lists them, else the family's rule. Qwen2/Qwen3 carry a `sliding_window` that only
    counts with `use_sliding_window: true` (then layers from max_window_layers on slide, as
    transformers' Qwen2Config builds its layer_types); a Llama/Mistral `sliding_window` applies to
    every layer; Gemma 3 slides on all but every `sliding_window_pattern`-th layer; Qwen3-Next
    has full attention on every `full_attention_interval`-th layer and linear attention
    elsewhere."""
    if config.get("layer_types") is not None:
        types = _strings(config, "layer_types", path)
        if len(types) != num_layers:
            raise InputError(f"{path}: field 'layer_types' has {len(types)} entries, "
                             f"num_hidden_layers is {num_layers}")
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                raise InputError(f"{path}: field 'layer_types' entry {i} is {t!r}, which simkv "
                                 f"does not size (known: {', '.join(LAYER_TYPES)})")
    elif architecture.startswith("Gemma3"):
        pattern = _int(config, "sliding_window_pattern", path, 6)
        types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention"
                      for i in range(num_layers))
    elif architecture == "Qwen3NextForCausalLM":
        interval = _int(config, "full_attention_interval", path, 4)
        types = tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention"
                      for i in range(num_layers))
    elif architecture.startswith("Qwen") or architecture == "MixtralForCausalLM":
        slides = _bool(config, "use_sliding_window", path, False) \
            and config.get("sliding_window") is not None
        first = _int(config, "max_window_layers", path, 0, minimum=0) if slides else num_layers
        types = tuple("sliding_attention" if i >= first else "full_attention"
                      for i in range(num_layers))
    elif architecture in ("LlamaForCausalLM", "MistralForCausalLM") \
            and config.get("sliding_window") is not None:
        types = ("sliding_attention",) * num_layers
    else:
        types = ("full_attention",) * num_layers
    window = None
    if "sliding_attention" in types:
        window = _int(config, "sliding_window", path)
        if architecture in MLA_ARCHITECTURES:
            raise InputError(f"{path}: sliding-window layers with MLA are not sized by simkv")
    if "linear_attention" in types and architecture != "Qwen3NextForCausalLM":
        raise InputError(f"{path}: 'linear_attention' layers are sized for Qwen3NextForCausalLM "
                         f"only (their state shape is the architecture's), not {architecture}")
    if "linear_attention" in types and "full_attention" not in types:
        raise InputError(f"{path}: a model of linear-attention layers only is not sized by simkv")
    return types, window


def _linear_attention(config: dict, path) -> LinearAttention:
    return LinearAttention(*(_int(config, k, path) for k in (
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim")))


def _vision(config: dict, path) -> Optional[Vision]:
    """Gemma 3's `vision_config` (a SigLIP tower), or None when the config has none."""
    v = config.get("vision_config")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise InputError(f"{path}: field 'vision_config' must be an object, got {v!r}")
    where = f"{path}: vision_config"
    return Vision(*(_int(v, k, where) for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "patch_size", "image_size")),
        num_channels=_int(v, "num_channels", where, 3))


def _text_config(config: dict, path) -> tuple:
    """(the fields of the language model, where they are): Gemma 3's checkpoint nests them under
    `text_config`; the architecture, quantization and dtype stay at the top."""
    text = config.get("text_config")
    if text is None:
        return config, path
    if not isinstance(text, dict):
        raise InputError(f"{path}: field 'text_config' must be an object, got {text!r}")
    merged = dict(text)
    for key in ("architectures", "quantization_config", "torch_dtype", "dtype",
                "tie_word_embeddings"):
        if key in config and key not in text:
            merged[key] = config[key]
    return merged, f"{path}: text_config"


def _quantization(config: dict, path: Path) -> Optional[Quantization]:
    """The checkpoint's `quantization_config`, or None when it has none."""
    q = config.get("quantization_config")
    if q is None:
        return None
    key = "quantization_config"
    if not isinstance(q, dict):
        raise InputError(f"{path}: field '{key}' must be an object, got {q!r}")
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise InputError(f"{path}: unsupported quantization method {method!r} in "
                         f"'{key}.quant_method' (supported: {', '.join(QUANT_METHODS)})")
    where = f"{key}.quant_method {method}"
    skip = _strings(q, "modules_to_not_convert", f"{path}: {key}")
    if method == "fp8":
        skip += _strings(q, "ignored_layers", f"{path}: {key}")
        block = q.get("weight_block_size")
        if block is not None:
            if not isinstance(block, list) or len(block) != 2 or not all(
                    isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
                raise InputError(f"{path}: field '{key}.weight_block_size' must be two positive "
                                 f"integers, got {block!r}")
            block = tuple(block)
        return Quantization("fp8", bits=8, block=block, skip=skip)
    if method == "mxfp4":
        return Quantization("mxfp4", bits=4, skip=skip)
    bits_key = "w_bit" if "w_bit" in q and "bits" not in q else "bits"
    bits = _int(q, bits_key, f"{path}: {key}")
    if bits not in (4, 8):
        raise InputError(f"{path}: field '{key}.{bits_key}' must be 4 or 8 ({where}), got {bits}")
    group_key = "q_group_size" if "q_group_size" in q and "group_size" not in q else "group_size"
    group = _value(q, group_key, f"{path}: {key}", -1)
    if isinstance(group, bool) or not isinstance(group, int) or (group <= 0 and group != -1):
        raise InputError(f"{path}: field '{key}.{group_key}' must be a positive integer or -1 "
                         f"(one group per column), got {group!r}")
    zero_point = _bool(q, "zero_point", f"{path}: {key}", True) if method == "awq" else True
    return Quantization(method, bits=bits, group_size=None if group == -1 else group,
                        zero_point=zero_point, skip=skip)


def quantization_for(weights_dtype: str, model_name: str, is_moe: bool) -> Optional[Quantization]:
    """The Quantization a `weights_dtype` override stands for: bf16 none; fp8 vLLM's on-the-fly
    fp8 (per-tensor scales, every linear layer of the decoder); int4 4-bit with a float16 scale
    and a 4-bit zero point per 128 input features (AWQ's layout); mxfp4 the routed experts in
    MXFP4 (gpt-oss's layout)."""
    if weights_dtype not in WEIGHTS_DTYPES:
        raise InputError(f"weights_dtype: {weights_dtype!r} is not one of "
                         f"{', '.join(WEIGHTS_DTYPES)}")
    if weights_dtype == "bf16":
        return None
    if weights_dtype == "fp8":
        return Quantization("fp8", bits=8, source="weights_dtype")
    if weights_dtype == "int4":
        return Quantization("awq", bits=4, group_size=128, source="weights_dtype")
    if not is_moe:
        raise InputError(f"weights_dtype: mxfp4 quantizes routed experts only and {model_name} "
                         "has none (fp8 or int4 quantize every linear layer)")
    return Quantization("mxfp4", bits=4, source="weights_dtype")


def model_from_config(config: dict, path: Path, name: Optional[str] = None,
                      weights_dtype: Optional[str] = None) -> ModelSpec:
    """Build a ModelSpec from a parsed HF `config.json` dict; `path` is used in error messages.
    `weights_dtype` (bf16 | fp8 | int4 | mxfp4) replaces the checkpoint's quantization."""
    if not isinstance(config, dict):
        raise InputError(f"{path}: expected a JSON object (an HF config.json)")
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not architectures \
            or not isinstance(architectures[0], str):
        raise InputError(
            f"{path}: missing required field 'architectures' "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise InputError(
            f"{path}: unsupported architecture {architecture!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    model_type = config.get("model_type")
    if model_type is not None and model_type not in MODEL_TYPES:
        raise InputError(f"{path}: unknown model_type {model_type!r} (known: "
                         f"{', '.join(MODEL_TYPES)}); simkv does not guess how its layers keep KV")
    vision = _vision(config, path) if architecture.startswith("Gemma3") else None
    top = config
    config, where = _text_config(config, path)

    num_layers = _int(config, "num_hidden_layers", where)
    num_heads = _int(config, "num_attention_heads", where)
    hidden_size = _int(config, "hidden_size", where)
    intermediate_size = _int(config, "intermediate_size", where)
    vocab_size = _int(config, "vocab_size", where)
    max_position_embeddings = _int(config, "max_position_embeddings", where)
    # Configs without num_key_value_heads are plain multi-head attention (as transformers reads
    # them); a 0 is refused, never read as "absent".
    num_kv_heads = _int(config, "num_key_value_heads", where, num_heads)
    if "head_dim" in config and config["head_dim"] is not None:
        head_dim = _int(config, "head_dim", where)
    elif hidden_size % num_heads:
        raise InputError(f"{where}: no 'head_dim', and hidden_size ({hidden_size}) is not a "
                         f"multiple of num_attention_heads ({num_heads})")
    else:
        head_dim = hidden_size // num_heads
    if num_heads % num_kv_heads != 0:
        raise InputError(
            f"{where}: num_attention_heads ({num_heads}) is not a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    tie = _bool(config, "tie_word_embeddings", where, architecture.startswith("Gemma3"))
    rope_scaling = config.get("rope_scaling")
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise InputError(f"{where}: field 'rope_scaling' must be an object or null, "
                         f"got {rope_scaling!r}")
    torch_dtype = config.get("torch_dtype", config.get("dtype", "bfloat16"))
    if not isinstance(torch_dtype, str):
        raise InputError(f"{where}: field 'torch_dtype' must be a string, got {torch_dtype!r}")

    mla: dict = {}
    if architecture in MLA_ARCHITECTURES:
        mla = {k: _int(config, k, where) for k in
               ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
        mla["q_lora_rank"] = _int(config, "q_lora_rank", where, None)
    experts = _experts(architecture, config, where, num_layers, intermediate_size) \
        if architecture in MOE_ARCHITECTURES else None
    layer_types = _strings(config, "layer_types", where) \
        if config.get("layer_types") is not None else None
    attention_types, window = _attention_types(architecture, config, where, num_layers)
    linear = _linear_attention(config, where) if "linear_attention" in attention_types else None
    qwen3_next = architecture == "Qwen3NextForCausalLM"
    gemma3 = _gemma3(config, where) if architecture.startswith("Gemma3") else {}
    shape = Shape(
        num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
        vocab_size=vocab_size, tie_word_embeddings=tie,
        attention_bias=_bool(config, "attention_bias", where, False),
        mlp_bias=_bool(config, "mlp_bias", where, False), experts=experts,
        attention_layers=sum(1 for t in attention_types if t != "linear_attention"),
        linear=linear, attn_output_gate=qwen3_next, vision=vision,
        shared_expert_gate=qwen3_next, **mla)
    weights = tuple(layout(architecture, shape))

    if name is None:
        name = path.parent.name if path.name == "config.json" else path.stem
    quantization = _quantization(top, path)
    if weights_dtype is not None:
        as_stored = quantization.weights_dtype if quantization else "bf16"
        quantization = quantization_for(weights_dtype, name, experts is not None)
        if weights_dtype != as_stored:
            # another checkpoint than the one profiled under `name`: its own name, so that no
            # profile or measured ledger of the stored weights is taken for it
            name = f"{name}-{weights_dtype}"
    return ModelSpec(
        name=name,
        architecture=architecture,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rope_theta=_number(config, "rope_theta", where,
                           GEMMA3_DEFAULTS["rope_theta"] if gemma3 else 10000.0),
        rope_scaling=rope_scaling,
        rms_norm_eps=_number(config, "rms_norm_eps", where, 1e-6),
        tie_word_embeddings=tie,
        num_params=sum(w.params for w in weights),
        torch_dtype=torch_dtype,
        path=path,
        weights=weights,
        experts=experts,
        quantization=quantization,
        kv_lora_rank=mla.get("kv_lora_rank"),
        qk_rope_head_dim=mla.get("qk_rope_head_dim"),
        qk_head_dim=(mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]) if mla else None,
        v_head_dim=mla.get("v_head_dim"),
        layer_types=layer_types,
        sliding_window=window,
        attention_types=attention_types,
        linear_attention=linear,
        model_type=model_type,
        **gemma3,
    )


def bundled_models() -> list[str]:
    """Names of the bundled model configs (`profiles/models/<name>.json`), sorted."""
    return sorted(p.stem for p in (profiles_dir() / "models").glob("*.json"))


def load_model(name_or_path: str | Path, weights_dtype: Optional[str] = None) -> ModelSpec:
    """Load a bundled model by name (`llama-3.1-8b`) or an HF `config.json` (or its folder) by
    path; `weights_dtype` (bf16 | fp8 | int4 | mxfp4) replaces the checkpoint's quantization."""
    text = str(name_or_path)
    bundled = profiles_dir() / "models" / f"{text.lower()}.json"
    if "/" not in text and os.sep not in text and bundled.is_file():
        return _read_model(bundled, name=text.lower(), weights_dtype=weights_dtype)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _read_model(path, weights_dtype=weights_dtype)
    if path.suffix == ".json" or "/" in text or os.sep in text:
        raise InputError(
            f"{text}: no such model config file (simkv reads local files only: give a bundled "
            "name or the path of a config.json)"
        )
    names = bundled_models()
    close = closest_name(text, names)
    hint = f"did you mean {close}? " if close else ""
    raise InputError(
        f"unknown model {text!r}: {hint}bundled models are {', '.join(names)}; "
        "or give a path to an HF config.json"
    )


def _read_model(path: Path, name: Optional[str] = None,
                weights_dtype: Optional[str] = None) -> ModelSpec:
    config = read_json_object(path, "an HF config.json")
    return model_from_config(config, path, name=name, weights_dtype=weights_dtype)


# ----------------------------------------------------------------------------------------------
# GPUs


@dataclass
class GpuSpec:
    """One GPU: memory, bandwidths (bytes/s) and dense tensor-core throughput (FLOP/s)."""

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float
    host_link_bytes_per_s: float                 # one direction of the host link (swap traffic)
    sources: dict[str, str] = field(default_factory=dict)   # figure name -> where it comes from
    description: str = ""
    price_usd_per_hour: Optional[float] = None   # on-demand rent of one GPU (None: unknown)
    price_source: str = ""                       # where the price comes from, and its date

    def flops_per_s(self, dtype: str) -> float:
        """Dense tensor-core FLOP/s for `bf16` or `fp8` math."""
        return self.fp8_flops_per_s if dtype == "fp8" else self.bf16_flops_per_s


_GPU_FIGURES = (
    "memory_bytes",
    "hbm_bandwidth_bytes_per_s",
    "bf16_flops_per_s",
    "fp8_flops_per_s",
    "host_link_bytes_per_s",
)


def _read_gpus() -> dict[str, Any]:
    return read_yaml_mapping(profiles_dir() / "gpus.yaml", "GPU name to specs")


def bundled_gpus() -> list[str]:
    """Names of the GPUs in `profiles/gpus.yaml`, in file order."""
    return list(_read_gpus())


def load_gpu(name: str) -> GpuSpec:
    """Load a bundled GPU (`h200`, `h100`, `a100-80gb`, `l40s`, `b200`) from `profiles/gpus.yaml`."""
    gpus = _read_gpus()
    path = profiles_dir() / "gpus.yaml"
    name = str(name).lower()
    if name not in gpus:
        close = closest_name(name, list(gpus))
        hint = f"did you mean {close}? " if close else ""
        raise InputError(f"unknown gpu {name!r}: {hint}bundled gpus are {', '.join(gpus)}")
    entry = gpus[name] or {}
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    for key in _GPU_FIGURES:
        figure = entry.get(key)
        if not isinstance(figure, dict) or "value" not in figure:
            raise InputError(f"{path}: {name}.{key}: missing (expected {{value: ..., source: ...}})")
        value = figure["value"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise InputError(f"{path}: {name}.{key}.value must be a positive number, got {value!r}")
        values[key] = value
        sources[key] = str(figure.get("source", ""))
    price = entry.get("price_usd_per_hour")       # optional: {value, source, date}
    if price is not None:
        value = price.get("value") if isinstance(price, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise InputError(f"{path}: {name}.price_usd_per_hour.value must be a positive "
                             f"number, got {value!r}")
        price_source = f"{price.get('source', '')} ({price.get('date', 'undated')})"
    return GpuSpec(
        name=name,
        memory_bytes=int(values["memory_bytes"]),
        hbm_bandwidth_bytes_per_s=float(values["hbm_bandwidth_bytes_per_s"]),
        bf16_flops_per_s=float(values["bf16_flops_per_s"]),
        fp8_flops_per_s=float(values["fp8_flops_per_s"]),
        host_link_bytes_per_s=float(values["host_link_bytes_per_s"]),
        sources=sources,
        description=str(entry.get("description", "")),
        price_usd_per_hour=float(price["value"]) if price is not None else None,
        price_source=price_source if price is not None else "",
    )
