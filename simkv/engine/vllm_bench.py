"""A run's metrics under `vllm bench serve`'s names and units (`simkv run ... --export vllm`).

vLLM's benchmark client (vllm/benchmarks/serve.py) saves a JSON with, per latency metric
(ttft, tpot, itl, e2el), `mean_<m>_ms`, `median_<m>_ms`, `std_<m>_ms` and `p<P>_<m>_ms` for
the percentiles asked for (`--metric-percentiles`, default 99), plus `duration`, `completed`,
`failed`, `total_input_tokens`, `total_output_tokens`, `request_throughput`,
`request_goodput` (None without `--goodput`), `output_throughput`, `total_token_throughput`
and `max_concurrent_requests`. This module computes the same from a simulated run, by the
same definitions: milliseconds; the standard deviation of the population (numpy's default);
linear percentiles; TPOT over requests with more than one output token; ITL over every gap
between consecutive tokens of every request; goodput the requests per second meeting every
per-request SLO. docs/vllm-names.md maps every summary key to vLLM's.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

PERCENTILES = (50, 90, 95, 99)
# vLLM's metric name -> simkv's per-request column (ITL: the scheduler's gaps)
METRICS = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2el": "e2e_s"}
# vLLM's --goodput names -> simkv's slo keys (vLLM takes them in ms, simkv in s)
GOODPUT_SLOS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s"}


def _stats(name: str, values_s, percentiles) -> dict:
    """mean/median/std/pP of `values_s` (seconds) in ms under vLLM's key names; zeros when
    there are none, as vLLM reports an empty list (np.mean([] or 0))."""
    values = np.asarray(values_s, dtype=np.float64)
    values = values[~np.isnan(values)]
    if not len(values):
        values = np.zeros(1)
    out = {f"mean_{name}_ms": float(np.mean(values)) * 1000,
           f"median_{name}_ms": float(np.median(values)) * 1000,
           f"std_{name}_ms": float(np.std(values)) * 1000}
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = float(np.percentile(values, p)) * 1000
    return out


def peak_concurrency(arrival_s, finish_s) -> int:
    """The most requests in flight at once over half-open intervals [arrival, finish)."""
    starts = np.sort(np.asarray(arrival_s, dtype=np.float64))
    ends = np.sort(np.asarray(finish_s, dtype=np.float64))
    if not len(starts):
        return 0
    # at each start, those started so far (ties with an end: the end goes first)
    in_flight = np.arange(1, len(starts) + 1) - np.searchsorted(ends, starts, side="right")
    return int(in_flight.max())


def vllm_bench_result(summary: dict, requests: pd.DataFrame, itl_s, *,
                      percentiles=PERCENTILES, model_id: str | None = None) -> dict:
    """`vllm bench serve`'s result JSON for a run: `summary` (summary.json), `requests`
    (requests.csv's frame) and `itl_s` (every inter-token gap, seconds)."""
    completed = requests[requests["status"] == "completed"]
    duration = float(summary["sim_duration_s"])
    total_input = int(completed["prompt_tokens"].sum())
    total_output = int(round(summary["throughput_output_tokens_per_s"] * duration)) \
        if duration > 0 else int(completed["output_tokens"].sum())
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: float("nan"))
    result = {
        "backend": "simkv",
        "model_id": model_id,
        "num_prompts": int(summary["requests_total"]),
        "duration": duration,
        "completed": int(len(completed)),
        "failed": int(summary["requests_cancelled"] + summary["requests_rejected"]),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": per_s(len(completed)),
        "request_goodput": summary.get("goodput_requests_per_s"),
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
        "max_concurrent_requests": peak_concurrency(completed["arrival_s"],
                                                    completed["finish_s"]),
    }
    columns = {**{m: completed[c] for m, c in METRICS.items() if m != "itl"}, "itl": itl_s}
    for name in METRICS:
        if columns[name] is not None:    # a run that kept no token gaps has no ITL figures
            result.update(_stats(name, columns[name], percentiles))
    return result
