"""Validation errors: the metrics compared, relative error, the issue's bounds and the table.

    error = (simulated - measured) / measured           per metric (ERROR_KEYS)
    load  = offered arrival rate / saturated throughput (requests/s, both on these requests)
"""
from __future__ import annotations

import math

ERROR_KEYS = ("ttft_s.mean", "ttft_s.p90", "tpot_s.mean", "e2e_s.mean",
              "throughput_output_tokens_per_s", "preemptions", "running_peak", "num_blocks")
# The bounds on |error| (issue 9): at load <= 0.7, and above it.
BOUNDS = {
    "low": {"ttft_s.mean": 0.05, "ttft_s.p90": 0.05, "tpot_s.mean": 0.03, "e2e_s.mean": 0.03,
            "throughput_output_tokens_per_s": 0.02},
    "high": {"ttft_s.mean": 0.15, "ttft_s.p90": 0.15, "tpot_s.mean": 0.03, "e2e_s.mean": 0.08,
             "throughput_output_tokens_per_s": 0.02},
    "all": {"preemptions": 0.10, "running_peak": 0.10, "num_blocks": 0.02},
}
LOW_LOAD = 0.7


def lookup(summary: dict, key: str):
    """The value at a dotted key (`ttft_s.mean`) of a summary; None where it is missing."""
    value = summary
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def relative_error(simulated, measured) -> float | None:
    """(simulated - measured) / measured; 0 when both are 0; None when undefined."""
    if simulated is None or measured is None:
        return None
    simulated, measured = float(simulated), float(measured)
    if not (math.isfinite(simulated) and math.isfinite(measured)):
        return None
    if measured == 0:
        return 0.0 if simulated == 0 else None
    return (simulated - measured) / measured


def check_bounds(error: dict, load) -> dict:
    """The issue's bounds on |error|: {metric: {bound, error, ok}} and `all_ok`."""
    regime = "low" if load is not None and load <= LOW_LOAD else "high"
    out = {"regime": f"load <= {LOW_LOAD}" if regime == "low" else f"load > {LOW_LOAD}"}
    ok = True
    for key, bound in {**BOUNDS[regime], **BOUNDS["all"]}.items():
        value = error.get(key)
        passed = value is not None and abs(value) <= bound
        out[key] = {"bound": bound, "ok": passed}
        ok &= passed
    out["all_ok"] = ok
    return out


def format_table(results: list) -> str:
    """A markdown table: one row per validation result."""
    keys = ERROR_KEYS
    head = "| scenario | load | " + " | ".join(keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 2)]
    for r in results:
        cells = [_pct(r["error"].get(k)) + ("" if r["bounds"].get(k, {}).get("ok", True)
                                            else " ✗") for k in keys]
        load = f"{r['load']:.2f}" if r["load"] is not None else "-"
        lines.append(f"| {r['name']} | {load} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"
