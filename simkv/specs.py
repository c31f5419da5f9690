"""Model and GPU specs: what the sizing arithmetic and the cost models know about the hardware.

Models are HF-style `config.json` files (bundled under `profiles/models/` or any path); GPUs come
from `profiles/gpus.yaml`. Both are input boundaries, so every problem raises InputError naming the
file and the field.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from simkv.errors import InputError, read_json_object

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Bytes per element of a KV cache entry.
KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1}


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
    """A dense decoder-only transformer, as far as memory and compute are concerned."""

    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: Optional[dict]
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_params: int
    torch_dtype: str
    path: Optional[Path] = None             # the config.json it was loaded from

    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """Bytes of KV cache one token occupies: K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * KV_DTYPE_BYTES[kv_dtype]

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of all weights at `dtype_bytes` per parameter (2 = bf16)."""
        return self.num_params * dtype_bytes

    def forward_flops(self) -> tuple:
        """(FLOPs per token of every layer but the embedding table and the LM head, per sampled
        row of the LM head, per query-key pair of attention) of one forward pass."""
        embed = self.vocab_size * self.hidden_size
        dense = self.num_params - embed * (1 if self.tie_word_embeddings else 2)
        return 2.0 * dense, 2.0 * embed, 4.0 * self.num_layers * self.num_heads * self.head_dim


def count_params(
    architecture: str,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    tie_word_embeddings: bool,
    attention_bias: bool = False,
    mlp_bias: bool = False,
) -> int:
    """Parameters of a Llama-shaped decoder (count, not bytes).

    Per layer: q/k/v/o projections, gated MLP (gate, up, down), two RMSNorms; Qwen2 always has
    q/k/v biases, Qwen3 adds per-head q/k RMSNorms. Plus token embeddings, the final norm and
    the LM head (shared with the embeddings when tied).
    """
    q_out = num_heads * head_dim
    kv_out = num_kv_heads * head_dim
    attention = hidden_size * q_out + 2 * hidden_size * kv_out + q_out * hidden_size
    if architecture == "Qwen2ForCausalLM":
        attention += q_out + 2 * kv_out                          # q/k/v bias, no o bias
    elif attention_bias:
        attention += q_out + 2 * kv_out + hidden_size            # q/k/v/o bias
    if architecture == "Qwen3ForCausalLM":
        attention += 2 * head_dim                                # q_norm, k_norm
    mlp = 3 * hidden_size * intermediate_size
    if mlp_bias:
        mlp += 2 * intermediate_size + hidden_size
    norms = 2 * hidden_size
    per_layer = attention + mlp + norms

    embeddings = vocab_size * hidden_size
    lm_head = 0 if tie_word_embeddings else vocab_size * hidden_size
    return num_layers * per_layer + embeddings + hidden_size + lm_head


def _required(config: dict, key: str, path: Path, kind: type) -> Any:
    if key not in config or config[key] is None:
        raise InputError(f"{path}: missing required field '{key}'")
    value = config[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise InputError(f"{path}: field '{key}' must be a positive integer, got {value!r}")
    return value


def model_from_config(config: dict, path: Path, name: Optional[str] = None) -> ModelSpec:
    """Build a ModelSpec from a parsed HF `config.json` dict; `path` is used in error messages."""
    if not isinstance(config, dict):
        raise InputError(f"{path}: expected a JSON object (an HF config.json)")
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or not architectures:
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

    num_layers = _required(config, "num_hidden_layers", path, int)
    num_heads = _required(config, "num_attention_heads", path, int)
    hidden_size = _required(config, "hidden_size", path, int)
    intermediate_size = _required(config, "intermediate_size", path, int)
    vocab_size = _required(config, "vocab_size", path, int)
    max_position_embeddings = _required(config, "max_position_embeddings", path, int)
    # Configs without num_key_value_heads are plain multi-head attention (as transformers reads them).
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    head_dim = config.get("head_dim") or hidden_size // num_heads
    if num_heads % num_kv_heads != 0:
        raise InputError(
            f"{path}: num_attention_heads ({num_heads}) is not a multiple of "
            f"num_key_value_heads ({num_kv_heads})"
        )
    tie = bool(config.get("tie_word_embeddings", False))

    if name is None:
        name = path.parent.name if path.name == "config.json" else path.stem
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
        rope_theta=float(config.get("rope_theta", 10000.0)),
        rope_scaling=config.get("rope_scaling"),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=tie,
        num_params=count_params(
            architecture, num_layers, num_heads, num_kv_heads, head_dim, hidden_size,
            intermediate_size, vocab_size, tie,
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
        ),
        torch_dtype=str(config.get("torch_dtype", "bfloat16")),
        path=path,
    )


def bundled_models() -> list[str]:
    """Names of the bundled model configs (`profiles/models/<name>.json`), sorted."""
    return sorted(p.stem for p in (profiles_dir() / "models").glob("*.json"))


def load_model(name_or_path: str | Path) -> ModelSpec:
    """Load a bundled model by name (`llama-3.1-8b`) or an HF `config.json` (or its folder) by path."""
    text = str(name_or_path)
    bundled = profiles_dir() / "models" / f"{text.lower()}.json"
    if "/" not in text and os.sep not in text and bundled.is_file():
        return _read_model(bundled, name=text.lower())
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _read_model(path)
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


def _read_model(path: Path, name: Optional[str] = None) -> ModelSpec:
    config = read_json_object(path, "an HF config.json")
    return model_from_config(config, path, name=name)


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
    path = profiles_dir() / "gpus.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: GPU specs file not found (set SIMKV_PROFILES?)") from None
    except yaml.YAMLError as e:
        raise InputError(f"{path}: bad YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of GPU name to specs")
    return data


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
