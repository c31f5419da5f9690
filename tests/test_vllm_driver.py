"""The vLLM driver's CPU half: the scenario's requests and settings as vLLM takes them, and a
pass's records as simkv's result files (simkv.gpu.vllm; no vLLM, no GPU)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from simkv.config.scenario import load_scenario, with_overrides
from simkv.engine.metrics import REQUEST_COLUMNS, STEP_COLUMNS
from simkv.errors import InputError
from simkv.gpu.vllm.engine_args import engine_kwargs, write_model_dir
from simkv.gpu.vllm.requests import (VllmRequest, sampling_kwargs, vllm_requests,
                                     with_output_cap)
from simkv.gpu.vllm.results import (inter_token_latencies, requests_frame, steps_frame,
                                    summarize)
from simkv.workload.frames import load_requests_frame

ROOT = Path(__file__).resolve().parent.parent
BURSTY = ROOT / "scenarios" / "validation" / "bursty-cancel-n2-bs16.yaml"
FIXTURE = Path(__file__).parent / "data" / "vllm_pass.json"


@pytest.fixture(scope="module")
def bursty():
    scn = load_scenario(BURSTY, overrides={"workload.synthetic.num_requests": 40})
    return scn, load_requests_frame(scn)


# -- requests -------------------------------------------------------------------------------

def test_every_request_keeps_its_lengths_samples_and_cancellation(bursty):
    scn, frame = bursty
    reqs = {r.request_id: r for r in vllm_requests(frame, scn.model.vocab_size, scn.seed)}
    assert len(reqs) == len(frame)
    for row in frame.itertuples():
        r = reqs[row.request_id]
        assert r.prompt_tokens == row.prompt_tokens
        assert r.output_tokens == row.output_tokens
        assert r.n == row.n
        assert (math.isnan(r.cancel_after_s) and math.isnan(row.cancel_after_s)) \
            or r.cancel_after_s == row.cancel_after_s
        assert all(0 <= t < scn.model.vocab_size for t in r.prompt_token_ids)


def test_requests_come_in_arrival_order_and_all_at_zero_for_the_saturated_pass(bursty):
    scn, frame = bursty
    timed = vllm_requests(frame, scn.model.vocab_size, scn.seed)
    assert [r.arrival_s for r in timed] == sorted(frame["arrival_s"])
    at_zero = vllm_requests(frame, scn.model.vocab_size, scn.seed, at_zero=True)
    assert {r.arrival_s for r in at_zero} == {0.0}
    assert [r.request_id for r in at_zero] == sorted(frame["request_id"])


def test_prompts_that_share_a_trace_prefix_share_its_tokens_and_no_more(bursty):
    scn, frame = bursty
    shared = frame[frame["prefix_ids"].map(lambda ids: bool(ids))]
    groups = shared.groupby(shared["prefix_ids"].map(lambda ids: ids[0]))
    twins = max((g for _, g in groups), key=len)
    assert len(twins) >= 2, "the fixture scenario has shared-prefix groups"
    first = twins.iloc[0]
    reqs = {r.request_id: r for r in vllm_requests(frame, scn.model.vocab_size, scn.seed)}
    a, b = (reqs[int(i)] for i in twins["request_id"].iloc[:2])
    block = int(first["prefix_block_tokens"])
    assert a.prompt_token_ids[:block] == b.prompt_token_ids[:block]
    others = [r for r in reqs.values() if not frame.set_index("request_id")
              .loc[r.request_id, "prefix_ids"]]
    assert others[0].prompt_token_ids[:block] != a.prompt_token_ids[:block]


def test_prompt_tokens_are_those_simkvs_engine_serves(bursty):
    from simkv.gpu.tokens import prompt_token_ids
    from simkv.workload.frames import requests_from_frame
    scn, frame = bursty
    ours = requests_from_frame(frame)[3]
    theirs = {r.request_id: r for r in vllm_requests(frame, scn.model.vocab_size, scn.seed)}
    assert list(theirs[ours.request_id].prompt_token_ids) == prompt_token_ids(
        ours, scn.model.vocab_size, scn.seed)


def test_sampling_asks_for_exactly_the_trace_output_per_sample():
    req = VllmRequest(7, 1.5, (1, 2, 3), output_tokens=12, n=2)
    kw = sampling_kwargs(req)
    assert kw["max_tokens"] == kw["min_tokens"] == 12
    assert kw["ignore_eos"] is True and kw["n"] == 2 and kw["detokenize"] is False
    assert "seed" not in kw


def test_the_warm_up_caps_outputs_and_vllm_ids_differ_between_passes():
    reqs = [VllmRequest(0, 0.0, (5,), 3), VllmRequest(1, 0.0, (6,), 40)]
    assert [r.output_tokens for r in with_output_cap(reqs, 4)] == [3, 4]
    assert reqs[1].vllm_id("saturated") != reqs[1].vllm_id("realtime")


def test_a_request_without_output_tokens_is_refused_at_the_boundary():
    frame = pd.DataFrame({"request_id": [0], "arrival_s": [0.0], "prompt_tokens": [10],
                          "output_tokens": [0], "n": [1], "prefix_ids": [None],
                          "prefix_block_tokens": [16], "tenant": [""], "adapter": [""],
                          "cancel_after_s": [math.nan]})
    with pytest.raises(InputError, match="request 0"):
        vllm_requests(frame, 1000)


# -- engine arguments -----------------------------------------------------------------------

def test_engine_arguments_pass_every_scheduling_setting_explicitly(tmp_path, bursty):
    scn, _ = bursty
    scn = with_overrides(scn, {"cache.block_size": 32, "scheduler.max_num_seqs": 64,
                               "scheduler.max_num_batched_tokens": 4096,
                               "cache.enable_prefix_caching": False,
                               "cache.gpu_memory_utilization": 0.8})
    kw = engine_kwargs(scn, write_model_dir(scn, tmp_path))
    assert (kw["block_size"], kw["max_num_seqs"], kw["max_num_batched_tokens"]) == \
        (32, 64, 4096)
    assert kw["enable_prefix_caching"] is False and kw["enable_chunked_prefill"] is True
    assert kw["gpu_memory_utilization"] == 0.8
    assert kw["load_format"] == "dummy" and kw["skip_tokenizer_init"] is True
    assert kw["max_model_len"] == scn.model.max_position_embeddings
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == scn.model.num_layers


def test_a_pool_override_counts_vllms_null_block(tmp_path, bursty):
    scn = with_overrides(bursty[0], {"cache.num_gpu_blocks_override": 1000,
                                     "scheduler.max_model_len": 8192})
    assert engine_kwargs(scn, tmp_path)["num_gpu_blocks_override"] == 1001


def test_swap_preemption_is_refused_since_vllm_only_recomputes(tmp_path, bursty):
    scn = with_overrides(bursty[0], {"cache.preemption_mode": "swap"})
    with pytest.raises(InputError, match="preemption_mode"):
        engine_kwargs(scn, tmp_path)


# -- results --------------------------------------------------------------------------------

def _record(rid, arrival, first, finish, out, *, n=1, status="completed", cached=0,
            events=()):
    return {"request_id": rid, "arrival_s": arrival, "sent_s": arrival, "prompt_tokens": 100,
            "output_tokens": out, "n": n, "status": status, "first_token_s": first,
            "finish_s": finish, "cached_tokens": cached, "events": [list(e) for e in events]}


def _step(t, running, waiting, usage, *, prefill=0, decode=0, preempted=0, elapsed_ms=10.0):
    return {"t_s": t, "num_running": running, "num_waiting": waiting, "kv_cache_usage": usage,
            "num_preempted": preempted, "num_prefill_tokens": prefill,
            "num_decode_tokens": decode, "elapsed_ms": elapsed_ms}


def test_latencies_count_from_the_trace_arrival():
    df = requests_frame([_record(1, 2.0, 2.5, 4.5, 5), _record(0, 0.0, 0.1, 0.1, 1)])
    assert list(df.columns) == REQUEST_COLUMNS
    assert list(df["request_id"]) == [0, 1]
    one = df.iloc[1]
    assert one["ttft_s"] == pytest.approx(0.5)
    assert one["e2e_s"] == pytest.approx(2.5)
    assert one["tpot_s"] == pytest.approx(0.5)          # (2.5 - 0.5) / (5 - 1)
    assert math.isnan(df.iloc[0]["tpot_s"])              # one output token: no TPOT


def test_a_cancelled_request_has_no_latencies():
    df = requests_frame([_record(0, 0.0, 0.2, 1.0, 8, status="cancelled")])
    assert df.iloc[0]["status"] == "cancelled"
    assert df[["ttft_s", "tpot_s", "e2e_s"]].isna().all(axis=None)


def test_inter_token_latencies_follow_each_sample_and_spread_a_burst():
    rec = _record(0, 0.0, 1.0, 2.0, 4, n=2,
                  events=[(1.0, 0, 1), (1.0, 1, 1), (1.2, 0, 1), (1.6, 1, 2), (2.0, 0, 2)])
    assert sorted(inter_token_latencies([rec])) == pytest.approx([0.2, 0.3, 0.3, 0.4, 0.4])


def test_steps_take_vllms_elapsed_time_and_its_used_fraction_of_usable_blocks():
    df = steps_frame([_step(0.5, 1, 2, 0.25, prefill=300, elapsed_ms=40.0),
                      _step(0.6, 3, 0, 0.5, decode=3, preempted=1, elapsed_ms=None)], 1000)
    assert list(df.columns) == STEP_COLUMNS + ["t_s"]
    assert list(df["kv_blocks_used"]) == [250, 500]
    assert list(df["kv_blocks_free"]) == [750, 500]
    assert df["duration_s"].tolist() == pytest.approx([0.04, 0.1])   # no details: the gap
    assert df["start_s"].iloc[0] == pytest.approx(0.46)


def test_the_summary_counts_what_vllm_served():
    records = [_record(0, 0.0, 0.1, 1.0, 10, cached=16), _record(1, 0.5, 0.7, 2.0, 10, n=2),
               _record(2, 1.0, None, 1.5, 10, status="cancelled")]
    steps = steps_frame([_step(1.0, 2, 1, 0.1, elapsed_ms=1000.0, preempted=1),
                         _step(2.0, 1, 0, 0.3, elapsed_ms=1000.0)], 100)
    s = summarize(records, steps, num_blocks=100, block_size=16, wall_time_s=2.1,
                  vllm_num_gpu_blocks=101)
    assert s["sim_duration_s"] == 2.0
    assert (s["requests_completed"], s["requests_cancelled"]) == (2, 1)
    assert s["throughput_output_tokens_per_s"] == pytest.approx(30 / 2.0)   # n = 2 counts twice
    assert s["ttft_s"]["mean"] == pytest.approx(0.15)
    assert (s["running_peak"], s["waiting_peak"], s["preemptions"]) == (2, 1, 1)
    assert s["running_mean"] == pytest.approx(1.5)
    assert s["kv_utilization_peak"] == pytest.approx(0.3)
    assert s["kv_utilization_mean"] == pytest.approx(0.2)
    assert (s["num_blocks"], s["vllm_num_gpu_blocks"]) == (100, 101)
    assert s["prefix_cache_hit_ratio"] == pytest.approx(16 / 300)


def test_a_recorded_vllm_pass_parses_to_consistent_files():
    data = json.loads(FIXTURE.read_text())          # recorded on the H200 (its "source")
    steps = steps_frame(data["steps"], data["usable_blocks"])
    s = summarize(data["requests"], steps, num_blocks=data["usable_blocks"],
                  block_size=data["block_size"], wall_time_s=0.0)
    df = requests_frame(data["requests"])
    done = df[df["status"] == "completed"]
    assert s["requests_completed"] == len(done) == len(data["requests"]) == 4
    for r in data["requests"]:                       # ignore_eos: exactly the trace's output
        assert sum(e[2] for e in r["events"]) == r["output_tokens"] * r["n"]
    assert (done["ttft_s"] > 0).all() and (done["e2e_s"] > done["ttft_s"]).all()
    assert (done["tpot_s"] > 0).all()
    assert steps["kv_blocks_used"].between(0, data["usable_blocks"]).all()
    assert (steps["duration_s"] > 0).all() and steps["t_s"].is_monotonic_increasing
    assert steps["num_prefill_tokens"].iloc[0] > 0   # the first step prefills
