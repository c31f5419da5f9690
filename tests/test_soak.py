"""Soak: random workloads on tight memory through the whole simulator, integrity checked every step.

Each run draws a scenario (both allocators, both preemption modes and victim policies, chunking
on/off, prefix caching on/off, tenant or global sharing, a watermark, a tiny host pool) and a
synthetic workload (bursty arrivals, n > 1, shared prefixes, tenants, cancellations, some requests
too long to serve), then asserts: no exception, the KV integrity check after every step, nothing
leaked, nothing held, every request completed, cancelled or rejected.

CI runs SIMKV_SOAK_RUNS (default 24) runs; a long run: `SIMKV_SOAK_RUNS=2000 python -m pytest -q
-n 2 tests/test_soak.py` (docs/fuzzing.md has the counts). SIMKV_SOAK_SEED shifts the seeds.
"""
import os
import random
from pathlib import Path

import pytest

import simkv
from simkv.sim.engine import Simulation

RUNS = int(os.environ.get("SIMKV_SOAK_RUNS", "24"))
BASE_SEED = int(os.environ.get("SIMKV_SOAK_SEED", "0"))
FINAL = {"completed", "cancelled", "rejected"}
# models with KV cache groups (tests/data): a 24-token window beside full attention, and
# linear-attention states beside full attention
HYBRID_RUNS = int(os.environ.get("SIMKV_SOAK_HYBRID_RUNS", "8"))
HYBRID_MODELS = [str(Path(__file__).resolve().parent / "data" / f"tiny-{kind}.json")
                 for kind in ("window", "linear")]


def random_scenario(seed: int) -> dict:
    """A small, memory-starved scenario; the seed decides everything."""
    rng = random.Random(seed)
    block_size = rng.choice([8, 16])
    max_model_len = rng.choice([128, 256, 384])
    allocator = rng.choice(["paged", "paged", "contiguous"])
    slab_blocks = -(-max_model_len // block_size)
    # from exactly one longest sequence up to a few of them: preemption is the rule, not the
    # exception
    num_blocks = rng.randint(slab_blocks, slab_blocks * (4 if allocator == "contiguous" else 3))
    chunking = rng.random() < 0.75
    max_num_seqs = rng.choice([2, 4, 8, 32])
    budget = rng.choice([32, 64, 256, 1024])
    budget = max(budget, max_num_seqs, 0 if chunking else max_model_len)
    prompt_max = int(max_model_len * rng.choice([0.5, 0.9, 1.3]))   # 1.3: some are rejected
    synthetic = {
        "num_requests": rng.randint(10, 40),
        "arrival": {"process": "gamma", "rate": rng.choice([20, 100, 500]), "cv": 2.0},
        "prompt_tokens": {"dist": "uniform", "min": 1, "max": prompt_max},
        "output_tokens": {"dist": "uniform", "min": 1, "max": rng.choice([8, 48])},
        "n": {"dist": "uniform", "min": 1, "max": rng.choice([1, 2, 4])},
        "cancel_fraction": rng.choice([0.0, 0.2, 0.5]),
        "cancel_max_s": rng.choice([0.05, 0.5]),
        "tenants": rng.randint(1, 3),
    }
    if rng.random() < 0.7:
        synthetic["shared_prefix"] = {"num_groups": rng.randint(1, 3),
                                      "prefix_tokens": rng.choice([16, 48, 96]),
                                      "fraction": rng.choice([0.5, 1.0]),
                                      "block_tokens": rng.choice([8, 16, 32])}
    return {
        "name": f"soak-{seed}",
        "model": "llama-3.1-8b",
        "cost_model": "roofline",
        "seed": seed,
        "cache": {
            "block_size": block_size,
            "num_gpu_blocks_override": num_blocks,
            "allocator": allocator,
            "enable_prefix_caching": rng.random() < 0.8,
            "prefix_sharing_scope": rng.choice(["tenant", "tenant", "global"]),
            "watermark": rng.choice([0.0, 0.0, 0.02]),
            "preemption_mode": rng.choice(["recompute", "swap"]),
            # llama-3.1-8b: 128 KiB per token, so 2-60 host blocks
            "swap_space_gib": rng.choice([0.004, 0.01, 0.06]),
        },
        "scheduler": {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": budget,
            "enable_chunked_prefill": chunking,
            "long_prefill_token_threshold": rng.choice([0, 0, 24]),
            "max_model_len": max_model_len,
            "preemption_policy": rng.choice(["recent", "priority"]),
        },
        "workload": {"synthetic": synthetic},
    }


def run_checked(raw: dict, trace_df=None):
    """Simulate with the integrity check on; assert that everything is accounted for."""
    scenario = simkv.load_scenario(raw)
    sim = Simulation(scenario, trace_df, check_integrity=True)
    result = sim.run()
    summary, requests = result.summary, result.requests
    assert summary["leaked_blocks"] == 0
    assert len(requests) == len(sim.frame) == summary["requests_total"]
    assert set(requests["status"]) <= FINAL, requests["status"].value_counts().to_dict()
    assert summary["requests_completed"] + summary["requests_cancelled"] \
        + summary["requests_rejected"] == len(requests)
    sched, kv = sim.scheduler, sim.scheduler.kv
    assert not sched.requests and not sched.waiting and not sched.running and not sched.swapped
    assert sched.num_running_seqs == 0 and kv.seqs == {} and kv.num_used_blocks == 0
    assert len(kv.host.free) == kv.host.num_blocks
    kv.check_integrity()
    return sim, result


@pytest.mark.parametrize("run", range(RUNS))
def test_random_tight_workload_runs_clean(run):
    run_checked(random_scenario(BASE_SEED + run))


@pytest.mark.parametrize("run", range(HYBRID_RUNS))
def test_random_tight_workload_of_a_hybrid_model_runs_clean(run):
    raw = random_scenario(BASE_SEED + 10_000 + run)
    raw["model"] = HYBRID_MODELS[run % 2]
    raw["cache"]["allocator"] = "paged"         # swap falls back to recompute for groups
    # a request takes blocks in both groups: twice the one-group pool, and a window's extra
    raw["cache"]["num_gpu_blocks_override"] = 2 * raw["cache"]["num_gpu_blocks_override"] + 1
    run_checked(raw)


def test_the_soak_mix_covers_every_mode():
    """The scenario mix reaches what the soak claims to cover (checked on the CI runs)."""
    seen = set()
    for seed in range(BASE_SEED, BASE_SEED + max(RUNS, 24)):
        raw = random_scenario(seed)
        cache, sched = raw["cache"], raw["scheduler"]
        seen.update({cache["allocator"], cache["preemption_mode"], sched["preemption_policy"],
                     ("chunking", sched["enable_chunked_prefill"]),
                     ("prefix caching", cache["enable_prefix_caching"]),
                     ("shared prefix", "shared_prefix" in raw["workload"]["synthetic"])})
    assert seen >= {"paged", "contiguous", "recompute", "swap", "recent", "priority",
                    ("chunking", True), ("chunking", False), ("prefix caching", True),
                    ("prefix caching", False), ("shared prefix", True)}
