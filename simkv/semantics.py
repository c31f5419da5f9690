"""`semantics:`: which vLLM's scheduling rules a scenario follows, rule by rule.

`vllm-0.26` (the default) follows vLLM v0.26.0; `vllm-0.18` is the older admission and parallel
sampling (and the pool and index as simkv modelled them before), under which every measurement
committed before the key existed was taken. Each rule is a key of its own; a key left null takes
its value from the semantics. docs/semantics.md lists the rules and the vLLM code each follows.
"""
from __future__ import annotations

from typing import Any

SEMANTICS = ("vllm-0.26", "vllm-0.18")
DEFAULT_SEMANTICS = "vllm-0.26"
MEASURED_SEMANTICS = "vllm-0.18"   # what a measurement without a recorded semantics ran under

# dotted key -> value under each semantics (the scheduler's limits are below: they depend on the GPU)
RULES: dict[str, dict[str, Any]] = {
    "scheduler.reserve_full_prompt": {"vllm-0.26": True, "vllm-0.18": False},
    "scheduler.parallel_sampling": {"vllm-0.26": "fanout", "vllm-0.18": "fork"},
    "scheduler.cap_output_tokens": {"vllm-0.26": True, "vllm-0.18": False},
    "cache.null_block": {"vllm-0.26": True, "vllm-0.18": False},
    "cache.duplicate_blocks": {"vllm-0.26": True, "vllm-0.18": False},
    "cache.pool_sizing": {"vllm-0.26": "vllm", "vllm-0.18": "engine"},
}

# vLLM v0.26 engine arguments, EngineArgs.get_batch_defaults (vllm/engine/arg_utils.py): an API
# server's (`vllm serve`) default max_num_seqs and max_num_batched_tokens: 1,024 and 8,192 on a
# GPU of at least 70 GiB that is not an A100, else 256 and 2,048.
VLLM_LARGE_GPU_BYTES = 70 * 2**30


def default_limits(semantics: str, gpu: Any) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) when the scenario leaves them out."""
    if semantics == "vllm-0.18":
        return 256, 8192
    if gpu.memory_bytes >= VLLM_LARGE_GPU_BYTES and "a100" not in gpu.name.lower():
        return 1024, 8192
    return 256, 2048


def resolve(semantics: str, cache: Any, scheduler: Any, gpu: Any) -> None:
    """Fill the rules the scenario leaves null from `semantics` (in place)."""
    sections = {"cache": cache, "scheduler": scheduler}
    for key, values in RULES.items():
        section, name = key.split(".")
        if getattr(sections[section], name) is None:
            setattr(sections[section], name, values[semantics])
    seqs, tokens = default_limits(semantics, gpu)
    if scheduler.max_num_batched_tokens is None:
        scheduler.max_num_batched_tokens = tokens
    if scheduler.max_num_seqs is None:
        scheduler.max_num_seqs = seqs
        if semantics != "vllm-0.18" and scheduler.max_num_batched_tokens > 0:
            # a defaulted max_num_seqs is at most the token budget (vllm/engine/arg_utils.py,
            # EngineArgs._set_default_max_num_seqs_and_batched_tokens_args)
            scheduler.max_num_seqs = min(seqs, scheduler.max_num_batched_tokens)
