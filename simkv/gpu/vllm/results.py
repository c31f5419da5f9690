"""What one pass of the vLLM engine recorded, as simkv's result files.

The driver records plain dicts (JSON-able, so a pass can be kept and parsed again):

- one per request: `request_id`, `arrival_s` (when the trace says it arrives), `sent_s` (when
  the client handed it to the engine), `prompt_tokens`, `output_tokens` (asked, per sample),
  `n`, `status` (completed | cancelled), `first_token_s` and `finish_s` (None when never),
  `cached_tokens` (vLLM's prefix-cache hit, tokens) and `events`: `[t_s, sample, new_tokens]`
  for each output the client received;
- one per engine step, from vLLM's scheduler and iteration stats: `t_s` (when the client side
  received it), `num_running`, `num_waiting`, `kv_cache_usage` (vLLM's used fraction of its
  usable blocks), `num_preempted`, `num_prefill_tokens`, `num_decode_tokens` and `elapsed_ms`
  (the step's time, None without vLLM's iteration details).

Times are seconds from the pass's start on the client's clock. `requests_frame`, `steps_frame`
and `summarize` turn them into requests.csv, steps.csv and summary.json with simkv's column and
key names, so that `simkv validate compare` reads a vLLM pass as it reads one of simkv's engine.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simkv.engine.metrics import REQUEST_COLUMNS, STEP_COLUMNS, latency_family

NAN = math.nan


def _time(value) -> float:
    return NAN if value is None else float(value)


def requests_frame(records: list) -> pd.DataFrame:
    """One row per request (simkv's REQUEST_COLUMNS), ordered by request id. TTFT and E2E count
    from the trace's arrival time, as a client sees them; TPOT = (E2E - TTFT) / (output - 1).
    vLLM does not say how often it preempted one request, nor what it recomputed: NaN."""
    rows = []
    for r in records:
        done = r["status"] == "completed"
        arrival, first, finish = float(r["arrival_s"]), _time(r["first_token_s"]), \
            _time(r["finish_s"])
        ttft = first - arrival if done else NAN
        e2e = finish - arrival if done else NAN
        out = int(r["output_tokens"])
        tpot = (e2e - ttft) / (out - 1) if done and out > 1 else NAN
        cached = r.get("cached_tokens")
        rows.append((int(r["request_id"]), arrival, int(r["prompt_tokens"]), out,
                     NAN if cached is None else int(cached), NAN, first, finish, ttft, tpot,
                     e2e, NAN, r["status"]))
    df = pd.DataFrame(rows, columns=REQUEST_COLUMNS)
    return df.sort_values("request_id", kind="stable").reset_index(drop=True)


def inter_token_latencies(records: list) -> np.ndarray:
    """Seconds between consecutive tokens of each sample, over all requests. An output that
    brings k tokens at once stands for k tokens spread evenly since the one before it."""
    gaps = []
    for r in records:
        last = {}
        for t, sample, new in r.get("events", ()):
            if sample in last and new > 0:
                gaps.extend([(t - last[sample]) / new] * new)
            last[sample] = t
    return np.asarray(gaps, dtype=np.float64)


def steps_frame(steps: list, num_blocks: int) -> pd.DataFrame:
    """One row per engine step with simkv's STEP_COLUMNS (`kv_blocks_used` from vLLM's used
    fraction of `num_blocks` usable blocks) and `t_s`, the time the client received it.
    `start_s` is `t_s` less the step's elapsed time (vLLM's iteration details), and
    `duration_s` that time; without details, the time since the step before."""
    rows, previous = [], 0.0
    for k, s in enumerate(steps, start=1):
        t = float(s["t_s"])
        elapsed = s.get("elapsed_ms")
        duration = float(elapsed) / 1e3 if elapsed is not None else max(0.0, t - previous)
        used = int(round(float(s["kv_cache_usage"]) * num_blocks))
        rows.append((k, t - duration, duration, int(s["num_prefill_tokens"]),
                     int(s["num_decode_tokens"]), int(s["num_running"]),
                     int(s["num_waiting"]), used, num_blocks - used,
                     int(s["num_preempted"]), t))
        previous = t
    return pd.DataFrame(rows, columns=STEP_COLUMNS + ["t_s"])


def finite_latency_family(values) -> dict:
    """{mean, p50, p90, p99} of the finite values (all None when there are none)."""
    values = np.asarray(values, dtype=np.float64)
    return latency_family(values[np.isfinite(values)])


def pass_duration_s(records: list) -> float:
    """From the pass's start to the last request's end (finished or given up)."""
    ends = [_time(r["finish_s"]) for r in records if r["finish_s"] is not None]
    return max(ends) if ends else 0.0


def summarize(records: list, steps: pd.DataFrame, *, num_blocks: int, block_size: int,
              wall_time_s: float, vllm_num_gpu_blocks: int | None = None) -> dict:
    """summary.json of one pass, under simkv's keys (INTERFACE.md) where vLLM measures the
    quantity; `num_blocks` is the usable pool (vLLM's count less its null block), and
    `vllm_num_gpu_blocks` vLLM's own count. Keys vLLM cannot give (swaps, copy-on-write,
    fragmentation) are left out rather than set to zero."""
    requests = requests_frame(records)
    completed = requests[requests["status"] == "completed"]
    duration = pass_duration_s(records)
    per_s = 1.0 / duration if duration > 0 else NAN
    samples = {int(r["request_id"]): int(r["n"]) for r in records}
    output = float((completed["output_tokens"] * completed["request_id"].map(samples)).sum())
    prompt = float(requests["prompt_tokens"].sum())
    cached = requests["cached_tokens"]
    weights = steps["duration_s"].to_numpy(dtype=np.float64)
    busy = float(weights.sum())
    used = steps["kv_blocks_used"].to_numpy(dtype=np.float64)

    def time_mean(values):
        return float((values * weights).sum() / busy) if busy > 0 else None

    summary = {
        "requests_total": int(len(requests)),
        "requests_completed": int(len(completed)),
        "requests_cancelled": int((requests["status"] == "cancelled").sum()),
        "requests_rejected": 0,
        "sim_duration_s": float(duration),
        "wall_time_s": float(wall_time_s),
        "throughput_requests_per_s": len(completed) * per_s,
        "throughput_output_tokens_per_s": output * per_s,
        "ttft_s": finite_latency_family(completed["ttft_s"]),
        "tpot_s": finite_latency_family(completed["tpot_s"]),
        "itl_s": finite_latency_family(inter_token_latencies(
            [r for r in records if r["status"] == "completed"])),
        "e2e_s": finite_latency_family(completed["e2e_s"]),
        "num_blocks": int(num_blocks),
        "vllm_num_gpu_blocks": vllm_num_gpu_blocks,
        "block_size": int(block_size),
        "num_steps": int(len(steps)),
        "kv_utilization_mean": (time_mean(used) / num_blocks
                                if num_blocks and busy > 0 else None),
        "kv_utilization_peak": float(used.max()) / num_blocks if len(used) and num_blocks
        else None,
        "running_mean": time_mean(steps["num_running"].to_numpy(dtype=np.float64)),
        "running_peak": int(steps["num_running"].max()) if len(steps) else 0,
        "waiting_peak": int(steps["num_waiting"].max()) if len(steps) else 0,
        "preemptions": int(steps["preempted"].sum()),
        "preemptions_per_s": float(steps["preempted"].sum()) * per_s,
        "prefix_cache_hit_ratio": (float(cached.sum()) / prompt
                                   if prompt and cached.notna().any() else None),
        "cached_tokens": int(cached.sum()) if cached.notna().any() else None,
        "cost_model": "measured (vLLM)",
    }
    return {k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in summary.items()}
