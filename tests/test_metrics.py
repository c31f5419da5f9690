"""Metric definitions on micro-scenarios small enough to compute by hand.

Every step costs a fixed time (FixedCost), so token times are step boundaries: a request whose
prompt is computed in the step [0, 1) has its first token at 1.0 s.
"""
import math

import pytest

import simkv
from simkv.workload.traces import build_trace
from simkv.sim.engine import simulate


class FixedCost:
    name = "fixed"

    def __init__(self, seconds=1.0):
        self.seconds = seconds

    def predict(self, plan):
        return self.seconds


def scenario(num_blocks=10, block_size=16, max_model_len=128, **cache):
    return simkv.load_scenario({
        "name": "micro", "model": "llama-3.1-8b", "gpu": "h200",
        "cache": {"block_size": block_size, "num_gpu_blocks_override": num_blocks, **cache},
        "scheduler": {"max_model_len": max_model_len, "max_num_batched_tokens": 64, "max_num_seqs": 16},
        "workload": {"synthetic": {"num_requests": 1, "arrival": {"process": "poisson",
                                                                  "rate": 1}}},
    })


def run(rows, cost=1.0, **kw):
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    frame = build_trace(cols, source="micro", format="csv")
    return simulate(scenario(**kw), trace_df=frame, cost_model=FixedCost(cost),
                    check_integrity=True)


def test_ttft_tpot_itl_e2e_for_one_request():
    # prompt 4, output 3: prefill in [0,1) -> token 1 at 1 s; decodes end at 2 s and 3 s.
    res = run([dict(arrival_s=0.0, prompt_tokens=4, output_tokens=3)])
    row = res.requests.iloc[0]
    assert row.ttft_s == 1.0
    assert row.e2e_s == 3.0
    assert row.tpot_s == (3.0 - 1.0) / (3 - 1)
    assert res.summary["itl_s"]["mean"] == 1.0
    assert res.summary["num_steps"] == 3


def test_ttft_counts_queueing_behind_a_busy_engine():
    # The second request arrives at 0.5 s while step [0,1) runs; it is admitted at 1 s and its
    # prompt is computed in [1,2) together with the first request's decode: TTFT = 2 - 0.5.
    res = run([dict(arrival_s=0.0, prompt_tokens=4, output_tokens=3),
               dict(arrival_s=0.5, prompt_tokens=4, output_tokens=2)])
    second = res.requests.iloc[1]
    assert second.ttft_s == pytest.approx(1.5)
    assert second.e2e_s == pytest.approx(2.5)


def test_internal_fragmentation_is_time_weighted_unfilled_slots():
    # One block of 16 slots: during the steps it holds 4, 5 and 6 tokens -> waste 12, 11, 10.
    res = run([dict(arrival_s=0.0, prompt_tokens=4, output_tokens=4)])
    assert res.summary["internal_fragmentation_mean"] == pytest.approx(
        (12 + 11 + 10 + 9) / 16 / 4)
    assert res.summary["kv_utilization_mean"] == pytest.approx(1 / 10)
    assert res.summary["kv_utilization_peak"] == pytest.approx(1 / 10)


def test_contiguous_fragmentation_counts_the_unused_reservation():
    # max_model_len 128 at block 16 reserves 8 blocks = 128 slots for a 4-token prompt.
    res = run([dict(arrival_s=0.0, prompt_tokens=4, output_tokens=2)], allocator="contiguous")
    assert res.summary["internal_fragmentation_mean"] == pytest.approx((124 / 128 + 123 / 128) / 2)
    assert res.summary["kv_utilization_mean"] == pytest.approx(8 / 10)


def test_blocks_per_seq_distribution_over_steps():
    # 20-token prompt at block 16: 2 blocks in every step it runs.
    res = run([dict(arrival_s=0.0, prompt_tokens=20, output_tokens=3)])
    assert res.summary["blocks_per_seq"] == {"mean": 2.0, "p50": 2, "p90": 2, "p99": 2}


def test_prefix_hit_ratio_counts_cached_prompt_tokens():
    # Two requests with the same 40-token prompt (ids at 16-token granularity): the second one,
    # arriving after the first finished, hits 2 full blocks = 32 of its 40 tokens.
    ids = (7, 8, 9)
    res = run([dict(arrival_s=0.0, prompt_tokens=40, output_tokens=2, prefix_ids=ids,
                    prefix_block_tokens=16),
               dict(arrival_s=10.0, prompt_tokens=40, output_tokens=2, prefix_ids=ids,
                    prefix_block_tokens=16)])
    assert list(res.requests.cached_tokens) == [0, 32]
    assert res.summary["prefix_cache_hit_ratio"] == pytest.approx(32 / 80)


def test_throughput_and_goodput():
    res = run([dict(arrival_s=0.0, prompt_tokens=4, output_tokens=3)])
    assert res.summary["sim_duration_s"] == 3.0
    assert res.summary["throughput_output_tokens_per_s"] == pytest.approx(1.0)
    assert res.summary["throughput_requests_per_s"] == pytest.approx(1 / 3)


def test_single_output_token_has_no_tpot():
    res = run([dict(arrival_s=0.0, prompt_tokens=4, output_tokens=1)])
    assert math.isnan(res.requests.iloc[0].tpot_s)
    assert res.requests.iloc[0].e2e_s == 1.0


def test_recompute_preemption_counts_recomputed_tokens():
    # 3 blocks of 4 slots; two 4-token prompts fill 2 blocks; each decode needs a new block, so
    # the later request is preempted, and on re-admission recomputes its lost tokens.
    res = run([dict(arrival_s=0.0, prompt_tokens=4, output_tokens=6),
               dict(arrival_s=0.0, prompt_tokens=4, output_tokens=6)],
              num_blocks=3, block_size=4, max_model_len=12, enable_prefix_caching=False)
    assert res.summary["preemptions"] >= 1
    second = res.requests.iloc[1]
    assert second.preemptions >= 1
    assert second.recomputed_tokens >= 4
    assert res.summary["leaked_blocks"] == 0

