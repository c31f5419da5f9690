"""Build the pieces of a run from a Scenario: the request frame, KV manager, scheduler, cost model.

Shared by the simulator and the real engine, so both see the same pool and the same knobs.
"""
from __future__ import annotations

import pandas as pd

from simkv.core.kv.contiguous import ContiguousKVCacheManager
from simkv.core.kv.manager import PagedKVCacheManager
from simkv.core.request import Request
from simkv.core.scheduler import Scheduler
from simkv.core.sizing import size_pool


def load_requests_frame(scenario) -> pd.DataFrame:
    """The scenario's requests as a canonical trace frame (trace file or synthetic generator),
    with `workload.time_scale` and `workload.limit` applied."""
    wl = scenario.workload
    if wl.trace is not None:
        from simkv.core.traces import load_trace
        return load_trace(wl.trace, format=wl.format, time_scale=wl.time_scale, limit=wl.limit)
    from simkv.sim.workload import generate_synthetic
    base_dir = scenario.base_dir or (scenario.path.parent if scenario.path else None)
    df = generate_synthetic(wl.synthetic or {}, scenario.seed, base_dir=base_dir)
    if wl.limit is not None:
        df = df.iloc[:wl.limit].copy()
    if wl.time_scale != 1.0:
        df["arrival_s"] = df["arrival_s"] * wl.time_scale
    return df


def requests_from_frame(df: pd.DataFrame) -> list:
    """Canonical trace frame -> Request objects (arrival order), for the simulator and the engine."""
    out = []
    cols = [df[c].tolist() for c in ("request_id", "arrival_s", "prompt_tokens", "output_tokens",
                                     "n", "prefix_ids", "prefix_block_tokens", "tenant",
                                     "adapter", "cancel_after_s")]
    for rid, arr, p, o, n, pid, pbt, tenant, adapter, cancel in zip(*cols):
        out.append(Request(int(rid), float(arr), int(p), int(o), n=int(n),
                           prefix_ids=pid if isinstance(pid, tuple) else None,
                           prefix_block_tokens=int(pbt), tenant=tenant or "",
                           adapter=adapter or "", cancel_after_s=float(cancel)))
    return out


def build_kv_manager(scenario, sizing=None):
    """The KV manager the scenario asks for, sized by `size_pool` (or the override)."""
    cache, sched = scenario.cache, scenario.scheduler
    sizing = sizing or size_pool(scenario.model, scenario.gpu, cache, sched)
    if cache.allocator == "contiguous":
        return ContiguousKVCacheManager(sizing.num_blocks, cache.block_size, sched.max_model_len,
                                        watermark=cache.watermark,
                                        num_host_blocks=sizing.num_host_blocks)
    return PagedKVCacheManager(sizing.num_blocks, cache.block_size,
                               enable_prefix_caching=cache.enable_prefix_caching,
                               watermark=cache.watermark, num_host_blocks=sizing.num_host_blocks)


def build_scheduler(scenario):
    """(Scheduler, Sizing) for a scenario."""
    cache, sched = scenario.cache, scenario.scheduler
    sizing = size_pool(scenario.model, scenario.gpu, cache, sched)
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
    )
    return scheduler, sizing


def build_cost_model(scenario):
    """`cost_model: auto` takes the profile for (gpu, model) when one exists, else roofline."""
    from simkv.costmodel import load_cost_model
    return load_cost_model(scenario)
