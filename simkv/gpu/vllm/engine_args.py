"""The scenario's settings as vLLM engine arguments (`vllm.AsyncEngineArgs(**kwargs)`).

Every setting that simkv models is passed explicitly, since vLLM's defaults differ from
simkv's (vLLM sizes `max_num_batched_tokens` and `max_num_seqs` by GPU, and turns chunked
prefill and prefix caching on or off by model). Weights are random (`load_format="dummy"`)
and the model is the scenario's HF config; there is no tokenizer (prompts are token ids).
"""
from __future__ import annotations

import json
from pathlib import Path

from simkv.errors import InputError

KV_CACHE_DTYPE = {"bf16": "auto", "fp8": "fp8"}    # auto: the model's dtype (bf16)


def unsupported_settings(scn) -> list:
    """What the scenario asks for that vLLM cannot do (messages; empty when none)."""
    cache, sched = scn.cache, scn.scheduler
    problems = []
    if cache.preemption_mode != "recompute":
        problems.append(f"cache.preemption_mode: {cache.preemption_mode} (vLLM v1 only "
                        "recomputes)")
    if cache.allocator != "paged":
        problems.append(f"cache.allocator: {cache.allocator} (vLLM's cache is paged)")
    if cache.memory_budget_gib is not None:
        problems.append("cache.memory_budget_gib (vLLM sizes by gpu_memory_utilization; "
                        "use cache.num_gpu_blocks_override for a fixed pool)")
    if cache.kv_dtype not in KV_CACHE_DTYPE:
        problems.append(f"cache.kv_dtype: {cache.kv_dtype}")
    if cache.watermark:
        problems.append(f"cache.watermark: {cache.watermark} (vLLM v1 has none)")
    if sched.preemption_policy != "recent":
        problems.append(f"scheduler.preemption_policy: {sched.preemption_policy}")
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len(scn):
        problems.append("scheduler.max_num_batched_tokens below max_model_len without chunked "
                        "prefill (vLLM refuses it)")
    return problems


def max_model_len(scn) -> int:
    """The scenario's max_model_len, or the model's context (as simkv takes it)."""
    return int(scn.scheduler.max_model_len or scn.model.max_position_embeddings)


def write_model_dir(scn, folder) -> Path:
    """A model folder for vLLM: the scenario's HF config.json alone (weights are random)."""
    if scn.model.path is None:
        raise InputError(f"model {scn.model.name}: vLLM needs its HF config.json file")
    config = json.loads(Path(scn.model.path).read_text())
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def engine_kwargs(scn, model_dir) -> dict:
    """`AsyncEngineArgs` keyword arguments that serve the scenario as simkv models it.

    Raises InputError naming every setting vLLM cannot honour.
    """
    problems = unsupported_settings(scn)
    if problems:
        raise InputError(f"{scn.name}: vLLM cannot serve this scenario as simkv models it: "
                         + "; ".join(problems))
    cache, sched = scn.cache, scn.scheduler
    kwargs = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "seed": int(scn.seed),
        "tensor_parallel_size": 1,
        "block_size": int(cache.block_size),
        "gpu_memory_utilization": float(cache.gpu_memory_utilization),
        "kv_cache_dtype": KV_CACHE_DTYPE[cache.kv_dtype],
        "enable_prefix_caching": bool(cache.enable_prefix_caching),
        "max_num_seqs": int(sched.max_num_seqs),
        "max_num_batched_tokens": int(sched.max_num_batched_tokens),
        "enable_chunked_prefill": bool(sched.enable_chunked_prefill),
        "max_model_len": max_model_len(scn),
        "disable_log_stats": False,                  # the scheduler's stats feed steps.csv
        "enable_logging_iteration_details": True,    # per step: tokens and elapsed time
    }
    if cache.num_gpu_blocks_override is not None:
        # simkv's override counts usable blocks; vLLM's count includes its null block
        kwargs["num_gpu_blocks_override"] = int(cache.num_gpu_blocks_override) + 1
    if sched.long_prefill_token_threshold:
        kwargs["long_prefill_token_threshold"] = int(sched.long_prefill_token_threshold)
    return kwargs
