"""What each of vLLM v0.26's rules changes in a prediction: a scenario under semantics vllm-0.18,
under vllm-0.26, and under vllm-0.26 with one rule at a time set back to vllm-0.18's.

    python benchmarks/semantics_effects.py [--scenario mooncake-memory ...] [--workers 2]
        [--json benchmarks/results/semantics_effects.json]

Scenarios: the names below (files in benchmarks/scenarios/ and scenarios/, shared traces
beside the repository). Prints one table per scenario; the JSON holds every run's summary
scalars with the command, date and commit. docs/semantics.md quotes its figures.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCENARIOS = {
    # Mooncake at its recorded rate on a 30 GiB budget: memory-bound, many preemptions
    "mooncake-memory": (REPO / "benchmarks" / "scenarios" / "mooncake-memory.yaml", {}),
    "mooncake-memory-no-prefix-cache": (
        REPO / "benchmarks" / "scenarios" / "mooncake-memory.yaml",
        {"cache.enable_prefix_caching": False}),
    # the whole Azure conv trace at twice its rate, 26 GiB (the what-if's tight budget)
    "azure-conv-26gib": (REPO / "scenarios" / "azure-conv.yaml",
                         {"workload.time_scale": 0.5, "cache.memory_budget_gib": 26}),
    # the bursty validation scenario: n = 2 on every request, cancellations, prefix caching off
    "bursty-n2-no-prefix-cache": (
        REPO / "scenarios" / "validation" / "bursty-cancel-n2-bs16.yaml",
        {"cache.enable_prefix_caching": False}),
}
OLD = {"scheduler.reserve_full_prompt": False, "scheduler.parallel_sampling": "fork",
       "scheduler.cap_output_tokens": False, "cache.null_block": False,
       "cache.duplicate_blocks": False, "cache.pool_sizing": "engine"}
KEYS = ("num_blocks", "preemptions", "ttft_s.p50", "ttft_s.p90", "tpot_s.mean", "tpot_s.p90",
        "e2e_s.p50", "throughput_output_tokens_per_s", "prefix_cache_hit_ratio",
        "kv_blocks_peak", "running_mean", "requests_completed", "requests_capped")


def variants() -> list:
    """(label, overrides): the two semantics, then vllm-0.26 less one rule."""
    out = [("vllm-0.18", {"semantics": "vllm-0.18"}), ("vllm-0.26", {"semantics": "vllm-0.26"})]
    for key, value in OLD.items():
        text = {True: "true", False: "false"}.get(value, value)
        out.append((f"vllm-0.26, {key.split('.')[-1]}={text}", {"semantics": "vllm-0.26",
                                                                 key: value}))
    return out


def _flat(summary: dict) -> dict:
    out = {}
    for key, value in summary.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        elif isinstance(value, (int, float)) or value is None:
            out[key] = value
    return out


def _run(job: tuple) -> tuple:
    name, label, path, overrides = job
    sys.path.insert(0, str(REPO))
    from simkv.config.scenario import load_scenario
    from simkv.sim.engine import simulate
    scn = load_scenario(path, overrides)
    result = simulate(scn)
    summary = _flat(result.summary)
    summary["kv_blocks_peak"] = int(result.steps["kv_blocks_used"].max()) \
        if len(result.steps) else 0
    return name, label, {k: summary.get(k) for k in KEYS}


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"{value:,}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    names = args.scenario or list(SCENARIOS)
    jobs = [(name, label, str(SCENARIOS[name][0]), {**SCENARIOS[name][1], **over})
            for name in names for label, over in variants()]
    results: dict = {name: {} for name in names}
    with ProcessPoolExecutor(args.workers) as pool:
        for name, label, row in pool.map(_run, jobs):
            results[name][label] = row
            print(f"done: {name} / {label}", file=sys.stderr, flush=True)
    for name in names:
        print(f"\n{name}")
        print("| run | " + " | ".join(KEYS) + " |")
        print("|---|" + "---|" * len(KEYS))
        for label, row in results[name].items():
            print(f"| {label} | " + " | ".join(_fmt(row[k]) for k in KEYS) + " |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip()
        record = {"command": "python benchmarks/semantics_effects.py "
                             + " ".join(argv if argv is not None else sys.argv[1:]),
                  "date": datetime.date.today().isoformat(), "commit": commit,
                  "python": platform.python_version(), "machine": platform.machine(),
                  "scenarios": {n: {"path": str(SCENARIOS[n][0].relative_to(REPO)),
                                    "overrides": SCENARIOS[n][1]} for n in names},
                  "results": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
