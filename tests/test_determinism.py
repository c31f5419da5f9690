"""Determinism (issue 11): the same scenario and seed give byte-identical requests.csv and
steps.csv and the same summary (wall time aside); different seeds differ; nothing depends on
Python's per-process string hashing (PYTHONHASHSEED).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import simkv

REPO = Path(__file__).resolve().parents[1]


def busy_scenario(seed=7, **cache):
    """Tight memory, n > 1, shared prefixes, tenants, cancellations: every path that decides."""
    return {
        "name": "determinism", "model": "llama-3.1-8b", "seed": seed,
        "cache": {"block_size": 16, "num_gpu_blocks_override": 48, "swap_space_gib": 0.01,
                  **cache},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 256, "max_model_len": 256,
                      "long_prefill_token_threshold": 64},
        "workload": {"synthetic": {
            "num_requests": 60, "arrival": {"process": "gamma", "rate": 40, "cv": 2.0},
            "prompt_tokens": {"dist": "lognormal", "mean": 80, "sigma": 0.8, "max": 240},
            "output_tokens": {"dist": "uniform", "min": 1, "max": 40},
            "n": {"dist": "uniform", "min": 1, "max": 3},
            "shared_prefix": {"num_groups": 2, "prefix_tokens": 48, "fraction": 0.6},
            "cancel_fraction": 0.2, "cancel_max_s": 1.0, "tenants": 2}},
    }


def run_to(raw, out: Path) -> dict:
    result = simkv.simulate(simkv.load_scenario(raw))
    result.write(out)
    return result.summary


def files(out: Path) -> dict:
    return {name: (out / name).read_bytes() for name in ("requests.csv", "steps.csv")}


def comparable(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "wall_time_s"}


@pytest.mark.parametrize("cache", [
    {"preemption_mode": "recompute"},
    {"preemption_mode": "swap"},
    {"allocator": "contiguous", "preemption_mode": "swap", "num_gpu_blocks_override": 64},
], ids=["paged-recompute", "paged-swap", "contiguous-swap"])
def test_same_scenario_and_seed_give_byte_identical_results(tmp_path, cache):
    raw = busy_scenario(**cache)
    if cache.get("allocator") == "contiguous":
        # each fanned-out child reserves its whole length at admission and never preempts;
        # forks need a slab of their own and do
        raw["scheduler"]["parallel_sampling"] = "fork"
    first = run_to(raw, tmp_path / "a")
    second = run_to(raw, tmp_path / "b")
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert comparable(first) == comparable(second)
    summary_a = json.loads((tmp_path / "a" / "summary.json").read_text())
    summary_b = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert comparable(summary_a) == comparable(summary_b)
    # the run is not trivially deterministic: it preempts, cancels and shares
    assert first["preemptions"] > 0 and first["requests_cancelled"] > 0
    if cache.get("allocator") != "contiguous":
        assert first["cached_tokens"] > 0


def test_different_seeds_give_different_results(tmp_path):
    run_to(busy_scenario(seed=7), tmp_path / "a")
    run_to(busy_scenario(seed=8), tmp_path / "b")
    a, b = files(tmp_path / "a"), files(tmp_path / "b")
    assert a["requests.csv"] != b["requests.csv"] and a["steps.csv"] != b["steps.csv"]


RUN_IN_SUBPROCESS = """
import sys, json, simkv
raw = json.loads(sys.argv[1])
simkv.simulate(simkv.load_scenario(raw)).write(sys.argv[2])
"""


def test_results_do_not_depend_on_the_python_hash_seed(tmp_path):
    """Block hashes chain Python's hash(); string keys (tenants, adapters) must not feed it."""
    raw = json.dumps(busy_scenario())
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        subprocess.run([sys.executable, "-c", RUN_IN_SUBPROCESS, raw, str(tmp_path / hash_seed)],
                       check=True, cwd=REPO, env=env, timeout=120)
    assert files(tmp_path / "1") == files(tmp_path / "2")
    run_to(busy_scenario(), tmp_path / "here")
    assert files(tmp_path / "here") == files(tmp_path / "1")
