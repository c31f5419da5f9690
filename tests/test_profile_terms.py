"""The profiled step model's window and expert terms: the profiler's grid for a model with
sliding layers or experts, the fit that prices them, and the cost model that charges them.

Synthetic profiles follow known coefficients over the grid the profiler would measure for the
model (tests/test_fit.py does the same for a dense one), so the fit must give them back; a fit
that ignores the window or the experts must miss the same times by far more.
"""
import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from simkv.costmodel import step_formula as SF
from simkv.costmodel.features import expected_experts_touched
from simkv.costmodel.profiled import FORWARD_TERMS, ProfiledCostModel
from simkv.fitting.step import fit_steps
from simkv.profile.design import design, design_for, features, model_terms, step_plan
from simkv.specs import load_model
from tests.test_fit import GRAPH_SIZES, known_coefs

BS = 16
MIXED_SIZES = (16, 32, 64, 128, 256, 512, 1024)


def layout_for(model) -> SF.StepLayout:
    points = design_for(model)
    knots = SF.token_knots_for(max(sum(n for _, n, _ in p.items) for p in points))
    return SF.StepLayout(tuple(knots), tuple(GRAPH_SIZES), mixed_token_sizes=MIXED_SIZES,
                         decode_tail_in_order=True, **model_terms(model))


def hybrid_coefs(layout) -> dict:
    """known_coefs for a model with a window and/or experts: the sliding layers' reads per
    token twice the full layers' (five of six layers slide), 40 us per touched expert."""
    coefs = known_coefs(BS)
    coefs["t_linear_s"] = [4e-3 + 2.2e-5 * max(0, k - 128) for k in layout.token_knots]
    coefs.update(c_mixed_seq_s=0.0, c_mixed_s=0.0, c_prefill_row_s=0.0,
                 a_prefill_tail_s_per_token=0.0)
    if layout.has_window:
        coefs.update(a_window_decode_s_per_token=8e-8, a_window_prefill_s_per_pair=1e-11)
    if layout.has_experts:
        coefs["a_expert_s"] = 4e-5
    return coefs


def synthetic_steps(model) -> pd.DataFrame:
    layout = layout_for(model)
    coefs = hybrid_coefs(layout)
    rows = []
    for point in design_for(model):
        f = features(point.items)
        f["graph"] = int(layout.is_graphed(f["num_prefill_tokens"], f["num_decode_seqs"]))
        f["decode_contexts"] = tuple(s + 1 for s, _, d in point.items if d)
        f["prefill_chunks"] = tuple((s, n) for s, n, d in point.items if not d and n >= 2)
        t = SF.predict_step(coefs, f, layout, BS)
        del f["decode_contexts"], f["prefill_chunks"]
        rows.append({"id": point.id, "family": point.family, "block_size": BS, **f,
                     "time_s": float(f"{t:.6g}")})
    return pd.DataFrame(rows)


def meta_for(model, with_terms: bool = True) -> dict:
    meta = {"model": model.name, "gpu": "h200", "graph_batch_sizes": GRAPH_SIZES,
            "mixed_token_sizes": list(MIXED_SIZES), "block_sizes": [BS]}
    if with_terms:
        meta["model_terms"] = model_terms(model)
    return meta


def test_the_grid_adds_window_and_expert_compositions_only_for_such_models():
    dense = design()
    assert design_for(load_model("llama-3.1-8b")) == dense
    gemma, qwen = load_model("gemma-3-27b"), load_model("qwen3-30b-a3b")
    assert model_terms(gemma) == {"sliding_window": 1024, "num_experts": 0, "experts_top_k": 0}
    assert model_terms(qwen) == {"sliding_window": 0, "num_experts": 128, "experts_top_k": 8}
    window = design_for(gemma)[len(dense):]
    experts = design_for(qwen)[len(dense):]
    # the dense grid comes first, unchanged (the hold-out rule counts positions in it)
    assert [p.id for p in design_for(gemma)[:len(dense)]] == [p.id for p in dense]
    assert window and all("/win/" in p.id for p in window)
    contexts = {s + 1 for p in window for s, _, d in p.items if d}
    assert min(contexts) < 1024 < max(contexts)          # below and past the window
    assert experts and all("/moe/" in p.id for p in experts)
    # expert compositions: token counts whose expected touched experts lie between those of
    # the captured graph sizes around them (what the padded rows' T_lin cannot tell apart)
    tokens = sorted({sum(n for _, n, _ in p.items) for p in experts})
    assert not set(tokens) & set(GRAPH_SIZES)
    touched = [expected_experts_touched(128, 8, t) for t in tokens]
    assert touched[0] < 30 and touched[-1] > 120


@pytest.mark.parametrize("name", ["gemma-3-27b", "qwen3-30b-a3b"])
def test_the_fit_gives_the_window_and_expert_terms_back_and_needs_them(name):
    model = load_model(name)
    steps = synthetic_steps(model)
    fit = fit_steps(steps, meta_for(model))
    coefs, truth = fit["step"][str(BS)], hybrid_coefs(layout_for(model))
    keys = ["a_window_decode_s_per_token", "a_window_prefill_s_per_pair"] if name.startswith(
        "gemma") else ["a_expert_s"]
    for key in keys:
        assert key in fit["coefficient_names"]
        assert coefs[key] == pytest.approx(truth[key], rel=0.02), key
    assert fit["holdout_error"]["median"] < 0.005
    assert fit["holdout_error"]["p95"] < 0.01
    # the same times fitted as if the model were dense and fully attending miss by far more
    blind = fit_steps(steps, meta_for(model, with_terms=False))
    assert not any(k in blind["step"][str(BS)] for k in keys)
    assert blind["holdout_error"]["p95"] > 5 * max(fit["holdout_error"]["p95"], 1e-3)


def profiled_model(model, coefs) -> ProfiledCostModel:
    layout = layout_for(model)
    fit = {"format": "simkv-fit/2", "gpu": "h200", "model": model.name, "block_sizes": [BS],
           "token_knots": list(layout.token_knots), "graph_batch_sizes": GRAPH_SIZES,
           "layout": layout.to_json(), "step": {str(BS): coefs}}
    return ProfiledCostModel(fit, "fit.json", BS, model=model)


@pytest.mark.parametrize("name", ["gemma-3-27b", "qwen3-30b-a3b"])
def test_the_cost_model_charges_the_terms_as_the_fit_predicts_them(name):
    model = load_model(name)
    layout = layout_for(model)
    coefs = dict(hybrid_coefs(layout), a_decode_s_per_token=[4e-8 * (1 + 4 / BS)])
    cost = profiled_model(model, coefs)
    term = "window_attention" if name.startswith("gemma") else "experts"
    assert term in FORWARD_TERMS
    for point in design_for(model)[::7]:
        plan = step_plan(point.items, BS)
        values = dict(zip(cost.term_names, cost.term_values(plan)))
        f = features(point.items)
        f["graph"] = int(layout.is_graphed(f["num_prefill_tokens"], f["num_decode_seqs"]))
        f["decode_contexts"] = tuple(s + 1 for s, _, d in point.items if d)
        f["prefill_chunks"] = tuple((s, n) for s, n, d in point.items if not d and n >= 2)
        assert cost.forward_seconds(plan) == pytest.approx(
            SF.predict_step(coefs, f, layout, BS), rel=1e-9), point.id
        assert values[term] > 0, point.id
    if term == "window_attention":   # past the window a sliding layer reads the window only
        short = cost.term_values(step_plan([(511, 1, True)] * 8, BS))
        long_ = cost.term_values(step_plan([(8191, 1, True)] * 8, BS))
        i = FORWARD_TERMS.index(term)
        assert short[i] == pytest.approx(8 * 512 * 8e-8)
        assert long_[i] == pytest.approx(8 * 1024 * 8e-8)
    else:                            # a graph's padding rows route as one more token
        i = FORWARD_TERMS.index(term)
        five = cost.term_values(step_plan([(511, 1, True)] * 5, BS))[i]
        assert five == pytest.approx(4e-5 * expected_experts_touched(128, 8, 6))


def test_a_fit_file_with_a_bad_expert_layout_is_one_error_naming_the_key(tmp_path):
    from simkv.errors import InputError
    model = load_model("qwen3-30b-a3b")
    layout = dataclasses.replace(layout_for(model), experts_top_k=0)
    fit = {"format": "simkv-fit/2", "gpu": "h200", "model": model.name, "block_sizes": [BS],
           "token_knots": list(layout.token_knots), "graph_batch_sizes": GRAPH_SIZES,
           "layout": dict(layout.to_json(), experts_top_k=0),
           "step": {str(BS): dict(hybrid_coefs(layout), a_decode_s_per_token=[1e-8])}}
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(fit))
    with pytest.raises(InputError, match="layout.num_experts"):
        ProfiledCostModel.load(path, BS, model=model)


def test_quick_profile_of_a_tiny_window_moe_hybrid_fits_its_terms(tmp_path):
    # the profiler end to end on CPU: a gpt-oss-shaped tiny hybrid (8-token window and full
    # layers alternating, Qwen3-MoE experts) through the quick grid and its window and expert
    # compositions; the fit names both terms and explain's table has them
    pytest.importorskip("triton")
    from simkv.fitting.profile import fit_profile
    from simkv.gpu.profiler.run import run_profile
    from tests.test_moe_engine import TINY_MOE
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_MOE, "layer_types": ["sliding_attention",
                                                              "full_attention"],
                                  "sliding_window": 8}))
    out = run_profile(str(config), block_sizes=(8,), out_dir=tmp_path / "prof", quick=True,
                      device="cpu", parts=("steps",), log=lambda *_: None)
    steps = pd.read_csv(out / "steps.csv")
    assert {"decode/win/b2/c16", "decode/moe/b3/c24"} <= set(steps["id"])
    meta = json.loads((out / "meta.json").read_text())
    assert meta["model_terms"] == {"sliding_window": 8, "num_experts": 8, "experts_top_k": 2}
    fit = fit_profile(out)
    names = fit["coefficient_names"]
    assert {"a_window_decode_s_per_token", "a_window_prefill_s_per_pair", "a_expert_s"} <= set(names)
    assert fit["layout"]["sliding_window"] == 8 and fit["layout"]["num_experts"] == 8
    assert np.isfinite(fit["holdout_error"]["median"])


def test_quick_profile_of_a_tiny_gemma_3_fits_the_window_attention_term(tmp_path):
    # Gemma 3's layers (tests/data/tiny-gemma3.json: two 16-token window layers, one full)
    # through the profiler's quick grid, the parts the H200 run asks for (the ledger and the
    # engine pass are CUDA-only and pass on the CPU), then the fit and the cost model it gives
    pytest.importorskip("triton")
    from pathlib import Path

    from simkv.fitting.profile import fit_profile
    from simkv.gpu.profiler.run import run_profile
    config = Path(__file__).parent / "data" / "tiny-gemma3.json"
    out = run_profile(str(config), block_sizes=(8,), out_dir=tmp_path / "prof", quick=True,
                      device="cpu", parts=("steps", "ledger", "engine"), log=lambda *_: None)
    steps = pd.read_csv(out / "steps.csv")
    assert {"decode/win/b2/c32", "prefill/win/1x16+p32"} <= set(steps["id"])
    assert json.loads((out / "meta.json").read_text())["model_terms"] == {
        "sliding_window": 16, "num_experts": 0, "experts_top_k": 0}
    fit = fit_profile(out)
    assert {"a_window_decode_s_per_token", "a_window_prefill_s_per_pair"} <= set(
        fit["coefficient_names"])
    model = load_model(str(config))
    cost = ProfiledCostModel.load(out / "fit.json", 8, model=model)
    values = dict(zip(cost.term_names, cost.term_values(step_plan([(47, 1, True)] * 2, 8))))
    assert "window_attention" in values and np.isfinite(values["window_attention"])


def test_the_sequences_of_a_profiled_step_feed_different_tokens():
    # a uniform decode batch whose sequences all read one id list feeds one token b times: a
    # MoE layer then routes every row to the same top-k experts (the H200 showed b = 64 at
    # 128 context faster than b = 48 padded to 64); each sequence reads its own window
    tokens = list(range(700_000))
    plan = step_plan([(511, 1, True)] * 64, BS, tokens=tokens)
    last = {item.seq.token_ids[511] for item in plan.scheduled}
    assert len(last) == 64
    assert all(len(item.seq.token_ids) == 512 for item in plan.scheduled)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-30b-a3b", "gemma-3-27b", "gpt-oss-20b",
                                  "mistral-7b-v0.3", "qwen3-next-80b-a3b"])
def test_the_profiler_builds_its_executor_as_the_engine_builds_its_own(name, monkeypatch):
    # the profile must time a model's steps as the engine serves them: the same KV cache groups
    # (a window hybrid's steps fill a slot mapping and block tables per group) and the same
    # graph settings. Both executors are recorded instead of built: the engine's as the
    # profiler's engine pass runs it (block size 16; on a B200, which holds all six), the
    # profiling executor at block size 16
    torch = pytest.importorskip("torch")
    from simkv.gpu import executor as executor_module
    from simkv.gpu.engine import Engine
    from simkv.gpu.engine_pass import pass_scenario
    from simkv.gpu.profiler.grid import profiling_executor
    built = []

    class Recorded:
        def __init__(self, model, num_blocks, block_size, *args, **kwargs):
            built.append(kwargs)
            self.num_blocks, self.block_size = num_blocks, block_size
            self.kv_groups = kwargs.get("kv_groups")
            self.caches = torch.zeros(1)

        def reserve_swap_space(self):
            pass

    monkeypatch.setattr(executor_module, "GpuExecutor", Recorded)
    model = load_model(name)
    Engine(pass_scenario(model, 0, "profile-engine-pass", "b200", 256, 40_000), "cpu")
    profiling_executor(model, 64, 16, "cpu")
    engine, profile = built
    assert profile["kv_groups"] == engine["kv_groups"]
    hybrid = name in ("gemma-3-27b", "gpt-oss-20b", "qwen3-next-80b-a3b")
    assert (profile["kv_groups"] is not None) == hybrid
    for setting in ("enforce_eager", "static_inputs", "max_num_seqs", "max_num_batched_tokens"):
        assert profile.get(setting, False) == engine.get(setting, False), setting
