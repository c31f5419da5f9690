"""ProfiledCostModel: step seconds from a fit.json, for a block size and KV dtype."""
import json
import math

import pytest

from simkv.profile.format import FIT_FORMAT

from simkv.engine.plan import ScheduledSeq, StepPlan
from simkv.engine.request import Sequence
from simkv.specs import load_gpu, load_model
from simkv.costmodel.profiled import ProfiledCostModel, find_profile
from simkv.errors import InputError

KNOTS = [1, 8, 64, 512]


def coefs(scale: float) -> dict:
    return {"t_linear_s": [1e-3 * scale, 2e-3 * scale, 3e-3 * scale, 1e-2 * scale],
            "a_decode_s_per_token": [1e-8 * scale], "a_prefill_s_per_pair": 1e-12,
            "a_prefill_ctx_s_per_token": 2e-9, "c_seq_s": 1e-6, "c_eager_s": 1e-4,
            "host_floor_s": 0.0, "host_floor_s_per_seq": 0.0, "c_mixed_seq_s": 0.0,
            "c_mixed_s": 0.0, "c_prefill_row_s": 0.0, "a_decode_longest_s_per_token": 0.0,
            "a_prefill_tail_s_per_token": 0.0}


# a layout without the GPU's programs: no kernel tails, every decode step up to 8 graphed
LAYOUT = {"sm_count": 0, "num_kv_heads": 1, "decode_tile": 64, "max_model_len": 0,
          "max_num_seqs": 256, "num_heads": 0, "prefill_tile": 64, "decode_slots_per_sm": 0.0,
          "prefill_slots_per_sm": 0.0, "decode_tail_in_order": False, "mixed_token_sizes": []}


def write_fit(tmp_path, **changes):
    fit = {"format": FIT_FORMAT, "gpu": "h200", "model": "llama-3.1-8b", "kv_dtype": "bf16",
           "layout": dict(LAYOUT),
           "block_sizes": [16, 64], "token_knots": KNOTS, "graph_batch_sizes": [1, 2, 4, 8],
           "kv_bytes_per_token": 131072, "form": "base",
           "step": {"16": coefs(1.0), "64": coefs(2.0)},
           "swap": {"out": {"c0_s": 1e-5, "c_block_s": 0.0, "c_byte_s": 2e-11},
                    "in": {"c0_s": 1e-5, "c_block_s": 0.0, "c_byte_s": 2e-11}},
           "copy": {"c0_s": 2e-5, "c_block_s": 1e-7, "c_byte_s": 0.0},
           "holdout_error": {"median": 0.01, "p95": 0.03}}
    if isinstance(changes.get("layout"), dict):      # the keys a test sets, the rest as LAYOUT
        changes["layout"] = {**LAYOUT, **changes["layout"]}
    fit.update(changes)
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(fit))
    return path


def plan_of(items, **extra) -> StepPlan:
    """A plan of (start, num_tokens, is_decode) items with the scheduler's features."""
    plan = StepPlan(step=0, now_s=0.0, **extra)
    for i, (start, n, is_decode) in enumerate(items):
        seq = Sequence(seq_id=i, request=None, sample=0, num_tokens=start + n)
        plan.scheduled.append(ScheduledSeq(seq, start, n, is_decode))
        if is_decode:
            plan.num_decode_tokens += 1
            plan.decode_context_tokens += start + 1
        else:
            plan.num_prefill_tokens += n
            plan.num_prefill_seqs += 1
            plan.prefill_context_tokens += start + n
            plan.prefill_attention_pairs += n * start + n * (n + 1) // 2
    return plan


def test_predicts_a_prefill_step_from_its_terms(tmp_path):
    m = ProfiledCostModel.load(write_fit(tmp_path), block_size=16)
    plan = plan_of([(0, 64, False)])                   # 64 tokens, eager
    pairs = 64 * 65 // 2
    expected = 3e-3 + 1e-12 * pairs + 2e-9 * 64 + 1e-6 + 1e-4
    assert m.predict(plan) == pytest.approx(expected)
    assert m.name == "profile:h200/llama-3.1-8b" and m.is_estimate is False


def test_a_one_token_prefill_chunk_costs_what_the_executor_runs_it_as_a_decode_row(tmp_path):
    # the executor runs every one-token item through the decode kernel: a full prefix hit's
    # recomputed last token beside decodes is a decode graph, not a mixed or eager step
    m = ProfiledCostModel.load(write_fit(tmp_path), block_size=16)
    as_chunk = plan_of([(99, 1, True), (255, 1, False), (99, 1, True)])
    as_decode = plan_of([(99, 1, True), (255, 1, True), (99, 1, True)])
    assert m.forward_seconds(as_chunk) == pytest.approx(m.forward_seconds(as_decode), rel=1e-12)
    # with a longer chunk beside it, the step is mixed and the one-token item a decode row
    with_chunk = plan_of([(0, 40, False), (255, 1, False)])
    rows_as_decode = plan_of([(0, 40, False), (255, 1, True)])
    assert m.forward_seconds(with_chunk) == pytest.approx(m.forward_seconds(rows_as_decode),
                                                          rel=1e-12)


def test_a_decode_batch_runs_as_a_graph_padded_to_its_bucket(tmp_path):
    m = ProfiledCostModel.load(write_fit(tmp_path), block_size=16)
    plan = plan_of([(99, 1, True)] * 3)                # 3 decodes -> graph of 4, no eager cost
    t_lin_at_4 = 1e-3 + (4 - 1) / (8 - 1) * (2e-3 - 1e-3)
    assert m.predict(plan) == pytest.approx(t_lin_at_4 + 1e-8 * 300 + 3e-6)


def test_a_decode_batch_beyond_the_captured_graphs_runs_eagerly(tmp_path):
    m = ProfiledCostModel.load(write_fit(tmp_path), block_size=16)
    plan = plan_of([(9, 1, True)] * 9)                 # 9 > 8 captured: eager, unpadded
    t_lin_at_9 = 2e-3 + (9 - 8) / (64 - 8) * (3e-3 - 2e-3)
    assert m.predict(plan) == pytest.approx(t_lin_at_9 + 1e-8 * 90 + 9e-6 + 1e-4)


def test_a_small_eager_step_takes_at_least_the_host_floor(tmp_path):
    fit = json.loads(write_fit(tmp_path).read_text())
    fit["step"]["16"].update(host_floor_s=0.02, host_floor_s_per_seq=1e-4)
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    m = ProfiledCostModel.load(tmp_path / "fit.json", block_size=16)
    assert m.predict(plan_of([(0, 64, False), (9, 1, True)])) == pytest.approx(0.0202)
    assert m.predict(plan_of([(9, 1, True)] * 2)) < 0.01          # graphed: no host floor


def test_copies_and_swaps_add_their_fitted_cost(tmp_path):
    m = ProfiledCostModel.load(write_fit(tmp_path), block_size=16,
                               model=load_model("llama-3.1-8b"))
    bytes_per_block = 131072 * 16
    plan = plan_of([], block_copies=[(1, 2), (3, 4)], swap_out=[(5, 0)])
    assert m.predict(plan) == pytest.approx(2e-5 + 2e-7 + 1e-5 + 2e-11 * bytes_per_block)
    assert m.predict(plan_of([])) == 0.0


def test_a_block_size_between_profiled_ones_is_interpolated_in_log2(tmp_path):
    m = ProfiledCostModel.load(write_fit(tmp_path), block_size=32)
    # log2(32) is halfway between log2(16) and log2(64): coefficients are the mean
    assert m.coefs["t_linear_s"][0] == pytest.approx(1.5e-3)
    assert m.coefs["a_decode_s_per_token"][0] == pytest.approx(1.5e-8)
    d = m.describe()
    assert d["interpolated"] is True and "interpolated" in d["notes"][0]
    assert d["profiled_block_sizes"] == [16, 64]
    lo = ProfiledCostModel.load(write_fit(tmp_path), block_size=16)
    hi = ProfiledCostModel.load(write_fit(tmp_path), block_size=64)
    plan = plan_of([(500, 1, True)] * 20 + [(0, 100, False)])
    assert lo.predict(plan) < m.predict(plan) < hi.predict(plan)


@pytest.mark.parametrize("block_size", [8, 128])
def test_a_block_size_outside_the_profiled_range_names_the_covered_sizes(tmp_path, block_size):
    from simkv.costmodel.profiled import BlockSizeNotProfiled
    with pytest.raises(BlockSizeNotProfiled, match=f"block size {block_size}.*16, 64") as e:
        ProfiledCostModel.load(write_fit(tmp_path), block_size=block_size)
    assert isinstance(e.value, InputError)


def test_corrupt_fit_json_names_the_file(tmp_path):
    path = tmp_path / "fit.json"
    path.write_text("{not json")
    with pytest.raises(InputError, match="fit.json.*not valid JSON"):
        ProfiledCostModel.load(path)


@pytest.mark.parametrize("key,where", [("token_knots", "token_knots"), ("step", "step")])
def test_a_missing_key_names_the_file_and_key(tmp_path, key, where):
    path = write_fit(tmp_path)
    fit = json.loads(path.read_text())
    del fit[key]
    path.write_text(json.dumps(fit))
    with pytest.raises(InputError, match=f"fit.json.*'{where}'"):
        ProfiledCostModel.load(path)


def test_a_missing_coefficient_names_its_block_size_and_key(tmp_path):
    fit = json.loads(write_fit(tmp_path).read_text())
    del fit["step"]["64"]["c_seq_s"]
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    with pytest.raises(InputError, match=r"'step\.64\.c_seq_s'"):
        ProfiledCostModel.load(tmp_path / "fit.json")


def test_a_non_numeric_coefficient_is_input_error(tmp_path):
    fit = json.loads(write_fit(tmp_path).read_text())
    fit["step"]["16"]["c_eager_s"] = "fast"
    (tmp_path / "fit.json").write_text(json.dumps(fit))
    with pytest.raises(InputError, match="c_eager_s"):
        ProfiledCostModel.load(tmp_path / "fit.json")


def test_a_profile_of_another_gpu_is_refused(tmp_path):
    with pytest.raises(InputError, match="h200.*h100"):
        ProfiledCostModel.load(write_fit(tmp_path), gpu=load_gpu("h100"))


def test_a_differently_shaped_model_is_refused(tmp_path):
    path = write_fit(tmp_path, model_shape={"num_layers": 32, "hidden_size": 4096})
    with pytest.raises(InputError, match="num_layers"):
        ProfiledCostModel.load(path, model=load_model("llama-3.2-1b"))


def test_fp8_kv_halves_the_kv_read_terms_and_says_so(tmp_path):
    m = ProfiledCostModel.load(write_fit(tmp_path), block_size=16, kv_dtype="fp8")
    assert m.coefs["a_decode_s_per_token"][0] == pytest.approx(0.5e-8)
    assert any("fp8" in n for n in m.describe()["notes"])


def test_find_profile_looks_under_profiles_gpu_model(tmp_path, monkeypatch):
    monkeypatch.setenv("SIMKV_PROFILES", str(tmp_path))
    assert find_profile("h200", "llama-3.1-8b") is None
    target = tmp_path / "h200" / "llama-3.1-8b"
    target.mkdir(parents=True)
    write_fit(target)
    assert find_profile("h200", "llama-3.1-8b") == target / "fit.json"


def test_predict_is_finite_over_a_range_of_plans(tmp_path):
    m = ProfiledCostModel.load(write_fit(tmp_path), block_size=16)
    for b in (1, 7, 8, 100, 1000):
        for ctx in (1, 100, 10000):
            t = m.predict(plan_of([(ctx - 1, 1, True)] * b + [(ctx, 300, False)]))
            assert math.isfinite(t) and t > 0


def test_the_committed_8b_profile_predicts_its_measured_decode_step():
    path = find_profile("h200", "llama-3.1-8b")
    if path is None:
        pytest.skip("no committed llama-3.1-8b profile")
    m = ProfiledCostModel.load(path, block_size=16, model=load_model("llama-3.1-8b"),
                               gpu=load_gpu("h200"))
    # measured on the H200: 64 decodes of 512 tokens took 6.93 ms (steps.csv, block size 16)
    assert m.predict(plan_of([(511, 1, True)] * 64)) == pytest.approx(6.93e-3, rel=0.08)
    assert m.describe()["holdout_error"]["count"] > 0


@pytest.mark.parametrize("model", ["llama-3.1-8b", "llama-3.2-1b"])
def test_the_model_predicts_what_the_fit_predicted_for_every_profiled_composition(model):
    # (the 1B's fit has a prefill tail term, the 8B's none)
    from simkv.costmodel import step_formula as SF
    from simkv.profile.design import design, features
    path = find_profile("h200", model)
    if path is None:
        pytest.skip(f"no committed {model} profile")
    fit = json.loads(path.read_text())
    layout = SF.StepLayout(tuple(fit["token_knots"]), tuple(fit["graph_batch_sizes"]),
                          **{k: v for k, v in fit["layout"].items()
                             if k not in ("token_knots", "graph_batch_sizes")})
    m = ProfiledCostModel.load(path, block_size=32)
    for point in design():
        f = features(point.items)
        f["graph"] = int(layout.is_graphed(f["num_prefill_tokens"], f["num_decode_seqs"]))
        # the decode sequences in batch order, as the fit takes them from the design by id
        f["decode_contexts"] = [s + 1 for s, _, is_decode in point.items if is_decode]
        f["prefill_chunks"] = [(s, n) for s, n, is_decode in point.items
                               if not is_decode and n >= 2]
        expected = SF.predict_step(fit["step"]["32"], f, layout, 32)
        plan = plan_of(point.items)
        expected += SF.engine_host_seconds(fit.get("engine_host"), len(plan.scheduled),
                                          plan.num_prefill_tokens)
        assert m.predict(plan) == pytest.approx(expected, rel=1e-9), point.id


# -- mixed-step graphs and the engine's own time -----------------------------------------------


def test_a_step_with_a_chunk_runs_as_a_mixed_graph_padded_to_its_token_size(tmp_path):
    # 3 decodes + a 30-token chunk = 33 tokens -> the mixed graph of 64 tokens: T_lin(64), the
    # per-row term of chunked steps on 64 rows, the mixed graph's constant and per-decode terms
    step = dict(coefs(1.0), c_prefill_row_s=1e-6, c_mixed_s=5e-4, c_mixed_seq_s=2e-5)
    path = write_fit(tmp_path, step={"16": step, "64": coefs(2.0)},
                     layout={"mixed_token_sizes": [16, 64, 256], "max_num_seqs": 256})
    m = ProfiledCostModel.load(path, block_size=16)
    plan = plan_of([(99, 1, True)] * 3 + [(0, 30, False)])
    expected = 3e-3 + 1e-8 * 300 + 1e-12 * (30 * 31 // 2) + 2e-9 * 30 + 4e-6 \
        + 1e-6 * 64 + 5e-4 + 2e-5 * 3
    assert m.predict(plan) == pytest.approx(expected)
    # past the largest captured size (256 tokens) the step is eager and unpadded
    big = plan_of([(99, 1, True)] * 3 + [(0, 297, False)])
    t_lin_300 = 3e-3 + (300 - 64) / (512 - 64) * (1e-2 - 3e-3)
    expected = t_lin_300 + 1e-8 * 300 + 1e-12 * (297 * 298 // 2) + 2e-9 * 297 + 4e-6 \
        + 1e-6 * 300 + 1e-4
    assert m.predict(big) == pytest.approx(expected)


def test_the_engine_host_term_is_added_to_every_step(tmp_path):
    engine = {"c0_s": 1e-4, "c_seq_s": 2e-6, "c_prefill_token_s": 1e-7}
    without = ProfiledCostModel.load(write_fit(tmp_path), block_size=16)
    with_host = ProfiledCostModel.load(write_fit(tmp_path, engine_host=engine), block_size=16)
    plan = plan_of([(99, 1, True)] * 3 + [(0, 40, False)])
    assert with_host.predict(plan) - without.predict(plan) == \
        pytest.approx(1e-4 + 2e-6 * 4 + 1e-7 * 40)
    assert with_host.describe()["engine_host"] == engine


def test_fit_engine_host_recovers_the_terms_of_the_engine_pass():
    import numpy as np
    import pandas as pd
    from simkv.fitting.fit import fit_engine_host
    rng = np.random.default_rng(3)
    seqs = rng.integers(1, 256, 400)
    prefill = np.where(rng.random(400) < 0.3, rng.integers(16, 8192, 400), 0)
    outside = 7e-5 + 1.7e-6 * seqs + 1.1e-7 * prefill
    fit = fit_engine_host(pd.DataFrame({"num_seqs": seqs, "num_prefill_tokens": prefill,
                                        "outside_s": outside}))
    assert fit["c0_s"] == pytest.approx(7e-5, rel=1e-3)
    assert fit["c_seq_s"] == pytest.approx(1.7e-6, rel=1e-3)
    assert fit["c_prefill_token_s"] == pytest.approx(1.1e-7, rel=1e-3)
    assert fit["rows"] == 400 and fit["median_abs_error_s"] < 1e-9


def test_the_profilers_engine_workload_is_seeded_and_serving_like():
    from simkv.gpu.engine_pass import engine_workload
    a, b = engine_workload(240, seed=0), engine_workload(240, seed=0)
    assert a.equals(b) and len(a) == 240 and (a["arrival_s"] == 0).all()
    assert 16 <= a["prompt_tokens"].min() and a["prompt_tokens"].max() <= 4000
    assert set(a["n"]) == {1, 2}
    shared = [ids[0] for ids in a["prefix_ids"] if ids[0] < 1000]     # the four shared prefixes
    assert 0.15 < len(shared) / 240 < 0.35


def test_the_step_layout_follows_the_scenarios_scheduler(tmp_path):
    # the engine captures graphs up to max_num_seqs and max_num_batched_tokens: a batch of 5
    # pads to 6 (not 8) and a mixed step of 90 tokens to 100 (the whole budget, not 256)
    from types import SimpleNamespace
    path = write_fit(tmp_path, layout={"mixed_token_sizes": [16, 32, 64, 128, 256],
                                       "max_num_seqs": 256, "max_model_len": 131072})
    sched = SimpleNamespace(max_num_seqs=6, max_num_batched_tokens=100, max_model_len=4096)
    m = ProfiledCostModel.load(path, block_size=16, scheduler=sched)
    assert m.graph_batch_sizes == [1, 2, 4, 6]
    assert m.layout.mixed_token_sizes == (16, 32, 64, 100)
    assert m.layout.max_model_len == 4096 and m.layout.max_num_seqs == 6
    t_lin_at_6 = 1e-3 + (6 - 1) / (8 - 1) * (2e-3 - 1e-3)
    assert m.predict(plan_of([(99, 1, True)] * 5)) == pytest.approx(t_lin_at_6 + 1e-8 * 500 + 5e-6)


def test_a_negative_decode_slot_count_is_refused_naming_the_key(tmp_path):
    path = write_fit(tmp_path, layout={"sm_count": 132, "num_kv_heads": 8,
                                       "decode_slots_per_sm": -1})
    with pytest.raises(InputError, match="layout.decode_slots_per_sm"):
        ProfiledCostModel.load(path)
    ok = write_fit(tmp_path, layout={"sm_count": 132, "num_kv_heads": 8, "decode_slots_per_sm": 3})
    assert ProfiledCostModel.load(ok).layout.decode_slots_per_sm == 3


def test_the_step_layout_keeps_the_graph_sizes_the_profiled_engine_captured(tmp_path):
    # a profile of an engine whose mixed graphs stopped at 256 tokens and decode graphs at 64:
    # a scenario with a larger budget still pads only within those lists (steps above run
    # eagerly there), whatever the current engine captures
    from types import SimpleNamespace
    path = write_fit(tmp_path, layout={"mixed_token_sizes": [16, 32, 64, 128, 256],
                                       "max_num_seqs": 256, "max_model_len": 131072})
    fit = json.loads(path.read_text())
    fit["graph_batch_sizes"] = [1, 2, 4, 8, 16, 32, 64]
    path.write_text(json.dumps(fit))
    sched = SimpleNamespace(max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
    m = ProfiledCostModel.load(path, block_size=16, scheduler=sched)
    assert m.layout.mixed_token_sizes == (16, 32, 64, 128, 256)
    assert m.graph_batch_sizes == [1, 2, 4, 8, 16, 32, 64]
    assert not m.layout.is_graphed(300, 4) and m.layout.is_graphed(250, 4)


def test_the_prefill_tail_is_a_short_chunk_over_a_long_prefix():
    # 128 tokens over 32,768 cached: 2 tiles x 32 heads = 64 programs of ~32,800 keys on 528
    # slots, far beyond the share; 1,024 new tokens: 512 programs of 64..1,024 keys
    from simkv.costmodel.step_formula import StepLayout
    layout = StepLayout((1,), sm_count=132, num_heads=32, prefill_tile=64,
                        prefill_slots_per_sm=4.0)
    share = 32 * (2 * 32768 + 64 + 128) / 528
    assert layout.prefill_tail_tokens([(32768, 128)]) == pytest.approx(32896 - share)
    assert layout.prefill_tail_tokens([(0, 1024)]) < 0.02 * layout.prefill_tail_tokens(
        [(32768, 128)])
    assert layout.prefill_tail_tokens([(0, 64)] * 64) == 0.0       # 2,048 programs, all alike
    assert StepLayout((1,), sm_count=132, num_heads=32).prefill_tail_tokens([(32768, 128)]) == 0
    assert layout.prefill_tail_tokens(None) == layout.prefill_tail_tokens([]) == 0.0


def test_a_fit_of_the_earlier_format_is_refused_with_the_command_that_refits_it(tmp_path):
    path = write_fit(tmp_path, format="simkv-fit/1")
    with pytest.raises(InputError, match=r"'simkv-fit/1', expected 'simkv-fit/2' \(re-run "
                                         r"`simkv fit .*` on the profile's measurements\)"):
        ProfiledCostModel.load(path)


@pytest.mark.parametrize("key", ["layout", "step.16.c_mixed_s", "layout.decode_slots_per_sm",
                                 "layout.decode_tail_in_order"])
def test_a_fit_without_a_key_of_its_format_names_the_key(tmp_path, key):
    path = write_fit(tmp_path)
    fit = json.loads(path.read_text())
    node, parts = fit, key.split(".")
    for part in parts[:-1]:
        node = node[part]
    del node[parts[-1]]
    path.write_text(json.dumps(fit))
    with pytest.raises(InputError, match=f"missing key '{key}'"):
        ProfiledCostModel.load(path)
