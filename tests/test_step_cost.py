"""Step costs as named terms: every model's terms sum to its prediction, explain shows one step,
--step-terms adds the terms to steps.csv."""
from __future__ import annotations

import math

import pytest

import simkv
from simkv.costmodel import load_cost_model
from simkv.errors import InputError
from simkv.sim.explain import explain_step, format_explanation


@pytest.fixture(scope="module")
def quickstart():
    return simkv.load_scenario("scenarios/quickstart.yaml",
                               overrides={"workload.synthetic.num_requests": 60})


@pytest.mark.parametrize("overrides", [{}, {"gpu_clock": "fixed"}, {"step_time_scale": 1.1},
                                       {"gpu_clock": "fixed", "step_time_scale": 0.9},
                                       {"cost_model": "roofline"}])
def test_every_steps_terms_sum_to_its_predicted_seconds(quickstart, overrides):
    scn = simkv.load_scenario("scenarios/quickstart.yaml", overrides={
        "workload.synthetic.num_requests": 60, **overrides})
    res = simkv.simulate(scn, step_terms=True)
    terms = res.steps.filter(like="term_")
    model = load_cost_model(scn)
    assert list(terms.columns) == [f"term_{n}" for n in model.term_names]
    sums = [math.fsum(row) for row in terms.itertuples(index=False)]
    assert sums == pytest.approx(res.steps["duration_s"].tolist(), rel=1e-12)


def test_step_terms_leave_the_results_unchanged(quickstart):
    plain = simkv.simulate(quickstart)
    with_terms = simkv.simulate(quickstart, step_terms=True)
    assert with_terms.summary["ttft_s"] == plain.summary["ttft_s"]
    assert with_terms.steps["duration_s"].tolist() == plain.steps["duration_s"].tolist()


def test_explain_gives_the_steps_plan_and_terms_that_sum_exactly(quickstart):
    found = explain_step(quickstart, 40)
    steps = simkv.simulate(quickstart).steps.set_index("step")
    assert found["seconds"] == math.fsum(found["terms"].values())
    assert found["seconds"] == pytest.approx(steps.loc[40, "duration_s"], rel=1e-12)
    assert found["plan"]["num_decode_tokens"] == steps.loc[40, "num_decode_tokens"]
    assert found["plan"]["num_prefill_tokens"] == steps.loc[40, "num_prefill_tokens"]
    assert found["terms"]["linear"] > 0
    assert "total" in format_explanation(found)


def test_a_decode_step_has_no_prefill_terms_and_a_mixed_step_has_them(quickstart):
    steps = simkv.simulate(quickstart).steps
    decode = int(steps[steps.num_prefill_tokens == 0].step.iloc[5])
    mixed = int(steps[(steps.num_prefill_tokens > 1) & (steps.num_decode_tokens > 0)].step.iloc[0])
    d, m = explain_step(quickstart, decode)["terms"], explain_step(quickstart, mixed)["terms"]
    assert d["prefill_attention"] == d["prefill_rows"] == 0.0 and d["decode_attention"] > 0
    assert m["prefill_attention"] > 0 and m["decode_attention"] > 0


def test_explain_past_the_last_step_names_how_many_there_are(quickstart):
    with pytest.raises(InputError, match="--step 100000: the simulation has"):
        explain_step(quickstart, 100_000)


def test_simkv_explain_prints_the_terms_and_json_whose_sum_is_the_seconds():
    from tests.test_cli_commands import simkv as run_simkv
    args = ("explain", "scenarios/quickstart.yaml", "--step", "100",
            "--set", "workload.synthetic.num_requests=60")
    text = run_simkv(*args)
    assert text.returncode == 0, text.stderr
    assert "linear" in text.stdout and "total" in text.stdout
    out = run_simkv(*args, "--json")
    import json
    found = json.loads(out.stdout)
    assert set(found) >= {"step", "plan", "terms", "seconds"} and found["step"] == 100
    assert found["seconds"] == math.fsum(found["terms"].values())
    bad = run_simkv("explain", "scenarios/quickstart.yaml", "--step", "0")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --step: 0 is not in [1, ")


def test_simkv_run_step_terms_writes_a_column_per_term(tmp_path):
    import pandas as pd
    from tests.test_cli_commands import simkv as run_simkv
    done = run_simkv("run", "scenarios/quickstart.yaml", "--set",
                     "workload.synthetic.num_requests=30", "--step-terms", "--json",
                     "--out", tmp_path)
    assert done.returncode == 0, done.stderr
    steps = pd.read_csv(tmp_path / "steps.csv")
    terms = steps.filter(like="term_")
    assert "term_linear" in terms and "term_clock" in terms
    # steps.csv keeps 10 significant digits
    assert terms.sum(axis=1).to_numpy() == pytest.approx(steps["duration_s"].to_numpy(), abs=1e-9)


def scenario_with(**cost_model):
    raw = {"name": "effects", "model": "llama-3.1-8b", "cost_model": cost_model,
           "workload": {"synthetic": {"num_requests": 60, "arrival": {"process": "poisson",
                                                                      "rate": 8},
                                      "prompt_tokens": {"dist": "fixed", "value": 600},
                                      "output_tokens": {"dist": "fixed", "value": 40},
                                      "n": 2}}}
    return simkv.load_scenario(raw)


def test_with_no_effects_a_step_is_the_plain_fitted_forward_time():
    res = simkv.simulate(scenario_with(effects=[]), step_terms=True)
    terms = res.steps.filter(like="term_")
    assert "term_clock" not in terms                      # no clock state
    for name in ("engine_host", "serving_prep", "shared_read_saving"):
        assert (terms[f"term_{name}"] == 0).all(), name
    assert res.summary["cost_model"] == "profile:h200/llama-3.1-8b (effects: none)"


def test_each_effect_adds_its_own_terms_and_nothing_else():
    host = simkv.simulate(scenario_with(effects=["engine_host"]), step_terms=True).steps
    shared = simkv.simulate(scenario_with(effects=["shared_reads"]), step_terms=True).steps
    assert (host["term_engine_host"] > 0).all() and (host["term_shared_read_saving"] == 0).all()
    assert (shared["term_engine_host"] == 0).all()
    assert (shared["term_shared_read_saving"] < 0).any()  # the n = 2 samples share a prompt


def test_the_default_effects_are_all_of_them_and_gpu_clock_fixed_drops_the_clock():
    assert scenario_with().effects == ("clock", "shared_reads", "engine_host")
    assert simkv.load_scenario("scenarios/quickstart.yaml",
                               overrides={"gpu_clock": "fixed"}).effects \
        == ("shared_reads", "engine_host")
    default = simkv.load_scenario("scenarios/quickstart.yaml")
    named = simkv.load_scenario("scenarios/quickstart.yaml", overrides={
        "cost_model.effects": "clock,shared_reads,engine_host"})
    assert load_cost_model(named).name == load_cost_model(default).name


@pytest.mark.parametrize("cost_model, message", [
    ({"effects": ["clock", "turbo"]}, "cost_model.effects: .*of clock, shared_reads, engine_host"),
    ({"effects": "clock"}, "cost_model.effects: expected a list"),
    ({"source": "auto", "colour": 1}, "unknown key cost_model.colour"),
])
def test_bad_effects_are_one_line_errors_naming_the_key(cost_model, message):
    with pytest.raises(InputError, match=message):
        scenario_with(**cost_model)
