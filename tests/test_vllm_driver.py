"""The vLLM driver's CPU half: the scenario's requests and settings as vLLM takes them, and a
pass's records as simkv's result files (simkv.gpu.vllm; no vLLM, no GPU)."""
from __future__ import annotations

import asyncio
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


def test_turns_and_multimodal_spans_are_refused_at_the_boundary():
    base = {"request_id": [0, 1], "arrival_s": [0.0, 1.0], "prompt_tokens": [10, 30],
            "output_tokens": [5, 5], "n": [1, 1], "prefix_ids": [None, None],
            "prefix_block_tokens": [16, 16], "tenant": ["", ""], "adapter": ["", ""],
            "cancel_after_s": [math.nan, math.nan]}
    turns = pd.DataFrame({**base, "parent_request_id": [-1, 0]})
    with pytest.raises(InputError, match="request 1 continues request 0"):
        vllm_requests(turns, 1000)
    images = pd.DataFrame({**base, "mm_spans": [None, ((2, 8, "cat"),)]})
    with pytest.raises(InputError, match="request 1 has multimodal spans"):
        vllm_requests(images, 1000)


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


# -- vLLM's step profile (simkv.gpu.vllm.step_profile: the CPU half) -------------------------

from simkv.gpu.vllm import step_profile as sp  # noqa: E402


def _logged(steps, t0=0.0, period=lambda s: 0.01):
    """Stat-logger records of predicted steps, the engine core's clock advancing by `period`."""
    out, t = [], t0
    for s in steps:
        t += period(s)
        out.append({"t_s": t + 0.001, "core_t_s": t, "num_running": 0, "num_waiting": 0,
                    "kv_cache_usage": 0.0, "num_preempted": 0,
                    "num_prefill_tokens": s.num_prefill_tokens,
                    "num_decode_tokens": len(s.decodes), "elapsed_ms": 0.05})
    return out


def test_a_decode_ladder_halves_its_batch_every_stage_after_the_last_prefill():
    reqs = sp.ladder_requests(1024, 256, 8192)
    steps = sp.predict(reqs, 8192)
    decode_only = [len(s.decodes) for s in steps if not s.chunks]
    assert decode_only == [b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1)
                           for _ in range(sp.STAGE_STEPS)]
    assert sum(s.num_prefill_tokens for s in steps) == 256 * 1024
    assert all(s.num_prefill_tokens + len(s.decodes) <= 8192 for s in steps)
    # the decodes run before the prompts: a prefill step takes what they leave of the budget
    assert all(s.num_prefill_tokens == 8192 - len(s.decodes) for s in steps
               if s.chunks and s is not [x for x in steps if x.chunks][-1])


def test_a_replayed_log_gives_each_chunk_its_start_and_each_decode_its_context():
    reqs = [(10000, 3), (300, 2)]
    steps, note = sp.reconstruct(reqs, _logged(sp.predict(reqs, 8192)))
    assert note is None
    assert [s.chunks for s in steps] == [[(0, 0, 8192)], [(0, 8192, 1808), (1, 0, 300)], [], []]
    assert [s.decodes for s in steps] == [[], [], [(0, 10001), (1, 301)], [(0, 10002)]]
    f = sp.step_features(steps[1])
    assert f["num_prefill_tokens"] == 2108 and f["num_prefill_seqs"] == 2
    assert f["prefill_context_tokens"] == 10000 + 300
    assert f["prefill_attention_pairs"] == 1808 * 8192 + 1808 * 1809 // 2 + 300 * 301 // 2
    f = sp.step_features(steps[2])
    assert (f["num_decode_seqs"], f["decode_context_tokens"], f["decode_max_context"]) == \
        (2, 10302, 10001)


def test_a_replay_stops_at_the_first_step_whose_decodes_disagree():
    reqs = [(100, 4), (100, 4)]
    log = _logged(sp.predict(reqs, 8192))
    log[2]["num_decode_tokens"] = 1                  # e.g. a request aborted by its client
    steps, note = sp.reconstruct(reqs, log)
    assert len(steps) == 2 and note.startswith("step 3: 1 decodes logged, 2 replayed")


def test_profile_rows_time_steps_by_the_engine_cores_period_and_group_a_stage():
    reqs = sp.ladder_requests(512, 4, 8192, stage_steps=5)
    steps = sp.predict(reqs, 8192)
    log = _logged(steps, 100.0, lambda s: 0.2 if s.chunks else 0.005 * (1 + len(s.decodes)))
    phase = {"name": "decode-c512-b4", "requests": [list(r) for r in reqs], "steps": log}
    rows, summary = sp.phase_rows(phase, 16, [1, 2, 4], [1, 2, 4, 8])
    assert summary["stopped"] is None and summary["clock"] == "core_t_s"
    decode = [r for r in rows if r["family"] == "decode"]
    # the first two decodes after the prefill step carry part of its time: left out
    assert [(r["num_decode_seqs"], r["reps"]) for r in decode] == [(4, 3), (2, 5), (1, 5)]
    assert [r["time_s"] for r in decode] == pytest.approx([0.025, 0.015, 0.010])
    assert all(r["graph"] == 1 for r in decode)
    # the phase's first step (after idle) has no period: the single prefill step is left out
    assert not [r for r in rows if r["family"] != "decode"]
    # an empty step between two steps voids the period of the second
    log.insert(3, dict(log[2], num_prefill_tokens=0, num_decode_tokens=0))
    rows2, _ = sp.phase_rows(dict(phase, steps=log), 16, [1, 2, 4], [1, 2, 4, 8])
    assert rows2[0]["reps"] == 2


def test_a_prompt_injected_into_a_decode_stream_takes_the_time_its_window_lost():
    reqs = [(100, 40), (100, 40), (50, 1)]      # two decoding, then one prompt arrives
    replay, steps = sp.Replay(reqs), []
    for tokens in [200] + [0] * 8 + [50] + [0] * 8:
        steps.append(replay.step(tokens))
    # the engine core releases the decode before the prompt 6 ms late, the prompt's step
    # 5 ms early and the one after 1 ms early: the window keeps the prompt's 9 ms
    shift = {8: 0.006, 9: -0.005, 10: -0.001}
    log, t = [], 0.0
    for k, s in enumerate(steps):
        t += (0.2 if k == 0 else 0.009 if k == 9 else 0.005) + shift.get(k, 0.0)
        log.append({"core_t_s": t, "t_s": t, "num_prefill_tokens": s.num_prefill_tokens,
                    "num_decode_tokens": len(s.decodes)})
    phase = {"name": "inject-b2", "requests": [list(r) for r in reqs], "steps": log}
    rows, summary = sp.phase_rows(phase, 16, [1, 2], [1, 2, 64])
    assert summary["stopped"] is None
    mixed = [r for r in rows if r["family"] == "mixed"]
    assert len(mixed) == 1 and mixed[0]["timing"] == "window"
    assert mixed[0]["time_s"] == pytest.approx(0.009)
    assert mixed[0]["period_s"] == pytest.approx(0.004)
    assert (mixed[0]["num_prefill_tokens"], mixed[0]["num_decode_seqs"]) == (50, 2)
    decode = [r for r in rows if r["family"] == "decode"]
    assert [r["time_s"] for r in decode] == pytest.approx([0.005, 0.005])


def test_a_graphed_step_follows_vllms_captured_sizes():
    decode = {"num_prefill_tokens": 0, "num_decode_tokens": 300, "num_decode_seqs": 300}
    mixed = {"num_prefill_tokens": 400, "num_decode_tokens": 100, "num_decode_seqs": 100}
    assert sp.graphed(decode, [1, 2, 256], [1, 512]) == 0
    assert sp.graphed(dict(decode, num_decode_tokens=256, num_decode_seqs=256),
                      [1, 2, 256], [1, 512]) == 1
    assert sp.graphed(mixed, [1, 256], [1, 512]) == 1
    assert sp.graphed(dict(mixed, num_prefill_tokens=413), [1, 256], [1, 512]) == 0


def test_a_raw_step_profile_builds_a_profile_that_simkv_fits(tmp_path):
    from simkv.fitting.profile import fit_profile

    def period(s):        # a made-up engine: linear layers by tokens, attention by context
        f = sp.step_features(s)
        return (0.005 + 2e-5 * (f["num_prefill_tokens"] + f["num_decode_tokens"])
                + 3e-9 * f["prefill_attention_pairs"] + 4e-8 * f["decode_context_tokens"])

    phases, t = [], 0.0
    for spec in (("ladder", 1024, 64), ("ladder", 8192, 8), ("burst", 1000, 30)):
        reqs = (sp.ladder_requests(spec[1], spec[2], 8192, stage_steps=4) if spec[0] == "ladder"
                else sp.burst_requests(spec[1], spec[2]))
        log = _logged(sp.predict(reqs, 8192), t, period)
        t = log[-1]["core_t_s"] + 1.0
        phases.append({"name": sp.phase_name(spec), "requests": [list(r) for r in reqs],
                       "steps": log, "wall_s": 1.0})
    raw = {"format": sp.RAW_FORMAT, "phases": phases, "meta": {
        "model": "llama-3.1-8b", "gpu": "h200", "date": "2026-12-02T00:00:00+00:00",
        "command": "python -m simkv.gpu.vllm.step_profile measure X --out Y",
        "versions": {"vllm": "0.26.0"}, "vllm_num_gpu_blocks": 56057, "sm_count": 132,
        "engine_kwargs": {"block_size": 16, "max_num_seqs": 256, "max_model_len": 131072},
        "full_graph_sizes": [1, 2, 4] + list(range(8, 257, 8)),
        "piecewise_graph_sizes": [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))}}
    meta = sp.build_profile(raw, tmp_path)
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert len(steps) == meta["rows"] >= 10 and set(steps["family"]) == {"decode", "mixed",
                                                                         "prefill"}
    assert all(p["stopped"] is None for p in meta["phases"])
    fit = fit_profile(tmp_path)
    assert fit["block_sizes"] == [16] and "engine_host" not in fit
    assert fit["holdout_error"]["median"] < 0.05


def test_full_budget_prefill_steps_released_in_bunches_keep_their_total_in_blocks():
    reqs = sp.ladder_requests(1024, 64, 8192, stage_steps=4)
    steps = sp.predict(reqs, 8192)
    full = [k for k, s in enumerate(steps) if s.num_prefill_tokens + len(s.decodes) == 8192]
    assert len(full) >= 6
    # every third full step comes out with the one before it, 0.35 s after that one's
    # predecessor: the same 0.2 s per step on average
    bunch = {k: (0.35 if n % 3 == 1 else 0.05 if n % 3 == 2 else 0.2)
             for n, k in enumerate(full[1:])}
    log = _logged(steps, 0.0, lambda s: 0.005)
    t, out = 0.0, []
    for k, rec in enumerate(log):
        t += bunch.get(k, 0.2 if steps[k].chunks else 0.005)
        out.append(dict(rec, core_t_s=t))
    rows, _ = sp.phase_rows({"name": "decode-c1024-b64", "requests": [list(r) for r in reqs],
                             "steps": out}, 16, [1, 64], [1, 512])
    blocks = [r for r in rows if r["timing"] == "block"]
    assert sum(r["reps"] for r in blocks) == len(full) - 1        # the first step has no period
    assert sum(r["time_s"] * r["reps"] for r in blocks) == pytest.approx(
        sum(bunch.values()))


class _FakeOutputs:
    """A request's output queue on a made-up engine: one token per `get`, finished after
    `max_tokens` (the step profile's params are its max_tokens here)."""

    def __init__(self, rid, max_tokens):
        self.request_id, self.left = rid, max_tokens

    def get_nowait(self):
        return None

    async def get(self):
        await asyncio.sleep(0)
        self.left -= 1
        return type("Out", (), {"finished": self.left <= 0})()


class _FakeEngine:
    def __init__(self):
        self.added, self.aborted = [], []

    async def reset_prefix_cache(self):
        pass

    async def add_request(self, rid, prompt, max_tokens):
        self.added.append((rid, len(prompt["prompt_token_ids"]), max_tokens))
        return _FakeOutputs(rid, max_tokens)

    async def abort(self, rid, internal=False):
        self.aborted.append(rid)


def test_a_mix_phase_serves_its_plan_in_order_and_records_each_arrival(monkeypatch):
    monkeypatch.setattr(sp, "_params", lambda max_tokens: max_tokens)
    monkeypatch.setattr(sp, "MIX_GAP_S", (0.0, 0.001))
    engine, sink = _FakeEngine(), sp._Sink()
    spec = ("mix", 6, 0, 4)
    phase = asyncio.run(sp._run_phase(engine, sink, spec, sp._Prompts(1000, 7), 8192, 256,
                                      sp.phase_name(spec)))
    base, injected, gaps = sp.mix_plan(6, 0, 4, 7)
    assert phase["name"] == "mix-b6-cspread-o4"
    # the decoding requests hold MIX_SPREAD's lengths in turn; the injected prompts every size
    # MIX_REPEATS times, shuffled, each decoding 4 tokens
    assert [p for p, _ in base] == [sp.MIX_SPREAD[j % len(sp.MIX_SPREAD)] for j in range(6)]
    assert sorted(p for p, _ in injected) == sorted(sp.MIX_SIZES * sp.MIX_REPEATS)
    assert [p for p, _ in injected] != sorted(p for p, _ in injected)
    assert phase["requests"] == [list(r) for r in base + injected]
    assert [(n, m) for _, n, m in engine.added] == base + injected
    # the same plan for the same arguments, another for another seed
    assert sp.mix_plan(6, 0, 4, 7) == (base, injected, gaps)
    assert sp.mix_plan(6, 0, 4, 8)[1] != injected
    assert all(0.0 <= g <= 0.001 for g in gaps)
    arrivals = phase["arrivals_s"]
    assert len(arrivals) == len(injected) and arrivals == sorted(arrivals)
    # the decoding requests end by vLLM's abort, the injected ones by their own outputs
    assert sorted(engine.aborted) == sorted(f"{phase['name']}-{j}" for j in range(6))


def test_a_prompt_right_after_a_request_leaves_takes_its_window_from_the_stream_after_it():
    # three decoding; one leaves in the step just before a prompt arrives, so the run of two
    # decodes before the prompt is that one (late-released) step
    reqs = [(100, 10 ** 3), (100, 10 ** 3), (100, 11), (50, 1)]
    replay, steps = sp.Replay(reqs), []
    for tokens in [300] + [0] * 11 + [50] + [0] * 8:
        steps.append(replay.step(tokens))
    assert [len(s.decodes) for s in steps[10:14]] == [3, 2, 2, 2]
    shift = {11: 0.006, 12: -0.005, 13: -0.001}
    log, t = [], 0.0
    for k, s in enumerate(steps):
        t += (0.2 if k == 0 else 0.009 if k == 12 else 0.005) + shift.get(k, 0.0)
        log.append({"core_t_s": t, "t_s": t, "num_prefill_tokens": s.num_prefill_tokens,
                    "num_decode_tokens": len(s.decodes)})
    rows, summary = sp.phase_rows({"name": "mix-b3-c100-o1", "requests": [list(r) for r in reqs],
                                   "steps": log}, 16, [1, 2, 4], [1, 2, 64])
    assert summary["stopped"] is None
    mixed = [r for r in rows if r["family"] == "mixed"]
    # the window less the one step's own (late) period would leave 3 ms; less the decodes'
    # 5 ms of the run after it, the prompt's 9 ms
    assert len(mixed) == 1 and mixed[0]["time_s"] == pytest.approx(0.009)


def test_raw_records_merge_with_repeated_phases_renamed_and_other_engines_refused():
    meta = {"model": "llama-3.1-8b", "gpu": "h200", "vllm_num_gpu_blocks": 56057,
            "full_graph_sizes": [1, 2], "piecewise_graph_sizes": [1, 2, 4],
            "async_scheduling": True, "date": "d1", "command": "c1",
            "engine_kwargs": {"model": "/tmp/a", "block_size": 16, "max_num_seqs": 256}}
    one = {"format": sp.RAW_FORMAT, "meta": meta,
           "phases": [{"name": "inject-b8"}, {"name": "decode-c1024-b256"},
                      {"name": "decode-c1024-b256-r2"}]}
    two = {"format": sp.RAW_FORMAT,
           "meta": dict(meta, date="d2", command="c2",
                        engine_kwargs=dict(meta["engine_kwargs"], model="/tmp/b")),
           "phases": [{"name": "mix-b8-c512-o1"}, {"name": "inject-b8"},
                      {"name": "decode-c1024-b256"}]}
    merged = sp.merge_raws([one, two], ["a.json", "b.json"])
    assert [p["name"] for p in merged["phases"]] == [
        "inject-b8", "decode-c1024-b256", "decode-c1024-b256-r2", "mix-b8-c512-o1",
        "inject-b8-r2", "decode-c1024-b256-r3"]
    assert [s["date"] for s in merged["meta"]["sources"]] == ["d1", "d2"]
    assert merged["meta"]["sources"][1]["phases"][1] == "inject-b8-r2"
    other = dict(two, meta=dict(two["meta"], engine_kwargs=dict(meta["engine_kwargs"],
                                                                block_size=32)))
    with pytest.raises(ValueError, match="b.json: engine settings block_size"):
        sp.merge_raws([one, other], ["a.json", "b.json"])
    with pytest.raises(ValueError, match="vllm_num_gpu_blocks"):
        sp.merge_raws([one, dict(two, meta=dict(two["meta"], vllm_num_gpu_blocks=1))])
