"""A fleet's summary: every key of a replica's summary.json as the fleet's (or a pool's) total,
plus `pools`, `replicas` and `router`.

Totals: counts, blocks, steps, preemptions, copies and swaps are sums; latency families are
over all requests (and all inter-token gaps); `sim_duration_s` is the last replica's end;
throughputs and rates are over it; KV utilisation is used over total blocks, time-weighted
(the replicas' used-block seconds over their busy seconds times their blocks); fragmentation
the same way; `running_mean` is the sum of the replicas' means; `kv_utilization_peak`,
`running_peak` and `waiting_peak` are the peak of the sum over time (each replica's value
holding from one of its steps to the next); the prefix-cache hit ratio is over every prompt
token looked up. A one-replica fleet's totals are that replica's summary, float for float.
"""
from __future__ import annotations

import math
from array import array

import numpy as np

from simkv.engine.metrics import _hist_family, hit_ratio_split, latency_family, slo_met


def _nan_to_none(summary: dict) -> dict:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in summary.items()}


def peak_of_sum(steps, column: str) -> float:
    """The peak over time of the sum over replicas of a steps column (each replica's value
    holds from its step's start to its next step's)."""
    if not len(steps):
        return 0
    times = steps["start_s"].to_numpy()
    values = steps[column]
    deltas = values.groupby(steps["replica"], sort=False).diff().fillna(values).to_numpy()
    level = np.cumsum(deltas)
    ends = np.append(times[1:] != times[:-1], True)     # the level once a time's events are in
    return int(round(level[ends].max()))


def aggregate(replicas: list, requests, steps, *, duration_s: float, slo: dict,
              hit_replicas: list | None = None) -> dict:
    """The summary keys over `replicas` (Replica objects), with `requests` their requests'
    rows (one per request) and `steps` their steps (with `replica`). `hit_replicas`: where
    prompts are looked up in the prefix cache (P/D: the prefill replicas; default all)."""
    completed = requests[requests["status"] == "completed"]
    scheds = [r.scheduler for r in replicas]
    recs = [r.recorder for r in replicas]
    hit_scheds = [r.scheduler for r in (hit_replicas or replicas)]
    duration = duration_s if duration_s > 0 else math.nan
    n_by_id = {}
    for s in scheds:
        n_by_id.update({q.request_id: 1 if q.children else q.n for q in s.done})
    samples = completed["request_id"].map(n_by_id).to_numpy()
    itl = array("d")
    for s in scheds:
        itl.extend(s.itl_s)
    busy_blocks = sum(rec.busy_s * r.scheduler.kv.num_blocks for rec, r in zip(recs, replicas))
    busy = sum(rec.busy_s for rec in recs)
    num_blocks = sum(s.kv.num_blocks for s in scheds)
    block_sizes = {r.scenario.cache.block_size for r in replicas}
    queried = sum(q.queried_tokens for s in hit_scheds for q in s.done)
    cached = sum(q.cached_tokens for s in hit_scheds for q in s.done)
    summary = {
        "requests_total": int(len(requests)),
        "requests_completed": int(len(completed)),
        "requests_cancelled": int((requests["status"] == "cancelled").sum()),
        "requests_rejected": int((requests["status"] == "rejected").sum()),
        "sim_duration_s": float(duration_s),
        "wall_time_s": 0.0,
        "throughput_requests_per_s": len(completed) / duration,
        "throughput_output_tokens_per_s": float(
            (completed["output_tokens"] * samples).sum()) / duration,
        "ttft_s": latency_family(completed["ttft_s"]),
        "tpot_s": latency_family(completed["tpot_s"]),
        "itl_s": latency_family(np.frombuffer(itl, dtype=np.float64) if len(itl) else []),
        "e2e_s": latency_family(completed["e2e_s"]),
        "queue_s": latency_family(completed["queue_s"]),
    }
    if slo:
        summary["goodput_requests_per_s"] = float(slo_met(completed, slo).sum()) / duration
    hist: list = []
    for rec in recs:
        h = rec.blocks_per_seq_hist
        if len(h) > len(hist):
            hist.extend([0] * (len(h) - len(hist)))
        for i, c in enumerate(h):
            hist[i] += c
    summary.update({
        "num_blocks": int(num_blocks),
        "block_size": int(next(iter(block_sizes))) if len(block_sizes) == 1 else None,
        "num_steps": int(sum(rec.num_steps for rec in recs)),
        "kv_utilization_mean": sum(rec.used_block_s for rec in recs) / busy_blocks
        if busy_blocks > 0 else math.nan,
        "kv_utilization_peak": peak_of_sum(steps, "kv_blocks_used") / num_blocks,
        "internal_fragmentation_mean": sum(rec.frag_s for rec in recs) / busy
        if busy > 0 else math.nan,
        "blocks_per_seq": _hist_family(hist),
        "running_mean": sum(rec.running_seq_s / rec.busy_s for rec in recs if rec.busy_s > 0)
        if busy > 0 else math.nan,
        "running_peak": int(peak_of_sum(steps, "num_running")),
        "waiting_peak": int(peak_of_sum(steps, "num_waiting")),
        "preemptions": int(sum(s.num_preemptions for s in scheds)),
        "preemptions_per_s": sum(s.num_preemptions for s in scheds) / duration,
        "swap_fallbacks": int(sum(s.num_swap_fallbacks for s in scheds)),
        "prefix_cache_hit_ratio": cached / queried if queried else 0.0,
        **hit_ratio_split([q for s in hit_scheds for q in s.done], cached, queried),
        "cached_tokens": int(cached),
        "recomputed_tokens": int(requests["recomputed_tokens"].sum()),
        "cow_copies": int(sum(s.kv.num_cow_copies for s in scheds)),
        "swapped_out_blocks": int(sum(s.kv.swapped_out_blocks for s in scheds)),
        "swapped_in_blocks": int(sum(s.kv.swapped_in_blocks for s in scheds)),
        "leaked_blocks": int(sum(s.kv.num_used_blocks for s in scheds)),
        "cost_model": ", ".join(dict.fromkeys(r.cost_model.name for r in replicas)),
    })
    if any(s.cap_output_tokens for s in scheds):
        summary["requests_capped"] = int(sum(s.num_capped for s in scheds))
    frag = [s.kv.external_fragmentation() for s in scheds
            if hasattr(s.kv, "external_fragmentation")]
    if frag:
        summary["external_fragmentation_end"] = sum(frag) / len(frag)
    summary = _nan_to_none(summary)
    notes = [getattr(r.cost_model, "note", "estimate from specs") for r in replicas
             if getattr(r.cost_model, "is_estimate", False)]
    if notes:
        summary["cost_model_note"] = notes[0]
    return summary


def _imbalance(values: list) -> float | None:
    """max / mean of per-replica figures (1.0: even), None when all are zero."""
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean > 0 else None


def fleet_summary(fleet, per_replica: list, requests, steps, wall_time_s: float) -> dict:
    """The fleet's summary.json (module doc); `per_replica`: (Replica, its summary, its
    requests frame) for each replica."""
    slo = fleet.scenario.slo
    replicas = [r for r, _, _ in per_replica]
    served = [r.served_s if r.served_s is not None else fleet.env.now for r in replicas]
    hit = fleet.by_role.get("prefill") if fleet.disagg is not None else None
    total = aggregate(replicas, requests, steps, duration_s=max(served, default=0.0), slo=slo,
                      hit_replicas=hit)
    total["wall_time_s"] = wall_time_s
    pools = []
    for pool, members in fleet.pools:
        if len(fleet.pools) == 1:            # the pool is the fleet
            pools.append({"name": pool.name, "role": pool.role, "replicas": pool.replicas,
                          "gpu": pool.scenario.gpu.name, "model": pool.scenario.model.name,
                          **{k: v for k, v in total.items() if k != "wall_time_s"}})
            break
        rows = [(r, s, df) for r, s, df in per_replica if r.pool is pool]
        import pandas as pd
        frame = pd.concat([df for _, _, df in rows], ignore_index=True).sort_values(
            "request_id", kind="stable")
        names = {r.name for r, _, _ in rows}
        pool_steps = steps[steps["replica"].isin(names)]
        agg = aggregate([r for r, _, _ in rows], frame, pool_steps,
                        duration_s=max(r.served_s or 0.0 for r, _, _ in rows), slo=slo)
        agg.pop("wall_time_s")
        pools.append({"name": pool.name, "role": pool.role, "replicas": pool.replicas,
                      "gpu": pool.scenario.gpu.name, "model": pool.scenario.model.name, **agg})
    replica_rows = [{"name": r.name, "pool": r.pool.name, "role": r.pool.role,
                     "gpu": r.scenario.gpu.name, **s} for r, s, _ in per_replica]
    busy = [r.recorder.busy_s for r in replicas]
    served_requests = [len(df) for _, _, df in per_replica]
    router = fleet.cluster.router
    total["pools"] = pools
    total["replicas"] = replica_rows
    total["router"] = {
        "policy": router.policy,
        "refresh_s": router.refresh_s,
        "prefix_cache_hit_ratio": total["prefix_cache_hit_ratio"],
        "load_imbalance": _imbalance(busy),
        "requests_imbalance": _imbalance(served_requests),
        "decode_runs": fleet.decode_runs,
    }
    if fleet.disagg is not None:
        total["kv_transfer"] = fleet.disagg.summary(requests)
    return total
