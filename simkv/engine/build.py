"""A replica's serving core from a Scenario: its KV manager and scheduler, sized by `size_pool`.

Shared by the simulator and the real engine, so both see the same pool and the same knobs.
"""
from __future__ import annotations

from simkv.engine.kv.contiguous import ContiguousKVCacheManager
from simkv.engine.kv.groups import HybridKVCacheManager
from simkv.engine.kv.paged import PagedKVCacheManager
from simkv.engine.scheduler import Scheduler
from simkv.errors import InputError
from simkv.limits import blocks_problem
from simkv.sizing import size_scenario


def build_kv_manager(scenario, sizing=None):
    """The KV manager the scenario asks for, sized by `size_scenario` (or the override)."""
    cache, sched = scenario.cache, scenario.scheduler
    sizing = sizing or size_scenario(scenario)
    _check_blocks(scenario, sizing)
    if cache.allocator == "contiguous":
        return ContiguousKVCacheManager(sizing.num_blocks, cache.block_size, sched.max_model_len,
                                        watermark=cache.watermark,
                                        num_host_blocks=sizing.num_host_blocks)
    groups = getattr(sizing, "kv_groups", None) or []
    if any(g["attention_type"] != "full" for g in groups):
        # windows or linear-attention states: a table per KV cache group (one full-attention
        # group, every layer or MLA's latent, stays with the paged manager)
        return HybridKVCacheManager(groups, sizing.num_blocks, sizing.block_size,
                                    enable_prefix_caching=cache.enable_prefix_caching,
                                    watermark=cache.watermark,
                                    max_num_batched_tokens=sched.max_num_batched_tokens,
                                    duplicate_blocks=bool(cache.duplicate_blocks))
    return PagedKVCacheManager(sizing.num_blocks, cache.block_size,
                               enable_prefix_caching=cache.enable_prefix_caching,
                               watermark=cache.watermark, num_host_blocks=sizing.num_host_blocks,
                               duplicate_blocks=cache.duplicate_blocks)


def build_scheduler(scenario):
    """(Scheduler, Sizing) for a scenario."""
    cache, sched = scenario.cache, scenario.scheduler
    sizing = size_scenario(scenario)
    kv = build_kv_manager(scenario, sizing)
    scheduler = Scheduler(
        kv,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        enable_chunked_prefill=sched.enable_chunked_prefill,
        long_prefill_token_threshold=sched.long_prefill_token_threshold,
        max_model_len=sched.max_model_len or scenario.model.max_position_embeddings,
        preemption_mode=cache.preemption_mode,
        preemption_policy=sched.preemption_policy,
        global_prefix_scope=cache.prefix_sharing_scope == "global",
        policy=sched.policy,
        reserve_full_prompt=sched.reserve_full_prompt,
        parallel_sampling=sched.parallel_sampling,
        cap_output_tokens=sched.cap_output_tokens,
        max_loras=sched.max_loras,
    )
    return scheduler, sizing


def _check_blocks(scenario, sizing) -> None:
    """InputError when a pool has more blocks than the simulator holds (simkv.limits)."""
    cache = scenario.cache
    where = getattr(scenario, "path", None) or "<scenario>"
    for num_blocks, what, key in (
            (sizing.num_blocks, "KV pool", "cache.num_gpu_blocks_override"
             if cache.num_gpu_blocks_override is not None else "cache.block_size"),
            (sizing.num_host_blocks, "host swap space", "cache.swap_space_gib")):
        problem = blocks_problem(num_blocks, what)
        if problem:
            raise InputError(f"{where}: {key}: {problem}")
