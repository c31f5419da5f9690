"""The GPU's clock state: a step's time follows the clock the work before it left."""
import json
import math
import pickle
from pathlib import Path

import pytest

from simkv.config.scenario import load_scenario
from simkv.specs import load_model
from simkv.costmodel import load_cost_model
from simkv.costmodel.clock import (CLOCK_FILE, ClockedCostModel, ClockModel, ClockState,
                                   step_flops)
from simkv.costmodel.profiled import ProfiledCostModel
from simkv.errors import InputError
from tests.test_profiled_costmodel import plan_of, write_fit

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "profiles" / "h200" / "llama-3.1-8b"

# 2,000 MHz light, 1,500 MHz at the cap; half of a step scales with the clock
CLOCK = ClockModel(max_mhz=2000.0, min_mhz=1500.0, knee_tflops=100.0, mhz_per_tflops=1.0,
                   sensitivity=0.5, tau_down_s=0.05, tau_up_s=0.02)


def test_the_settling_clock_falls_with_the_flop_rate_above_the_knee_down_to_the_floor():
    assert CLOCK.settling_mhz(50.0) == 2000.0
    assert CLOCK.settling_mhz(300.0) == 1800.0
    assert CLOCK.settling_mhz(900.0) == 1500.0


def test_the_slowdown_scales_the_clock_sensitive_share_of_a_step():
    # slowdown(1600) = 1 + 0.5 * (2000 / 1600 - 1) = 1.125
    assert CLOCK.slowdown(1600.0) == pytest.approx(1.125)
    assert CLOCK.slowdown(2000.0) == 1.0


def test_light_work_after_idle_runs_at_full_clock():
    state = ClockState(CLOCK)
    assert state.run_step(0.0, 0.010, 2000.0) == pytest.approx(0.010)
    assert state.mhz == 2000.0


def test_heavy_work_back_to_back_slows_toward_its_settling_clock():
    state = ClockState(CLOCK)
    times, now = [], 0.0
    for _ in range(20):
        t = state.run_step(now, 0.020, 1500.0)
        times.append(t)
        now += t
    assert times[0] < times[1] < times[5]
    assert times[-1] == pytest.approx(0.020 * CLOCK.slowdown(1500.0), rel=1e-3)


def test_the_clock_comes_back_over_an_idle_gap():
    state = ClockState(CLOCK)
    now = 0.0
    for _ in range(20):
        now += state.run_step(now, 0.020, 1500.0)
    after_heavy = state.run_step(now, 0.005, 2000.0)
    state_2 = ClockState(CLOCK)
    state_2.mhz, state_2.free_at_s = 1500.0, now
    after_rest = state_2.run_step(now + 0.2, 0.005, 2000.0)       # 10 time constants idle
    assert after_heavy > 0.005 * 1.05
    assert after_rest == pytest.approx(0.005, rel=1e-3)


def test_reset_puts_the_gpu_back_at_full_clock():
    state = ClockState(CLOCK)
    state.run_step(0.0, 0.5, 1500.0)
    state.reset()
    assert state.mhz == 2000.0 and state.free_at_s is None


def test_step_flops_count_dense_layers_lm_head_and_attention_pairs():
    model = load_model("llama-3.1-8b")
    per_token, per_sample, per_pair = model.forward_flops()
    plan = plan_of([(0, 4, False), (9, 1, True)])    # 4 prefill tokens; a decode of context 10
    expected = per_token * 5 + per_sample * 2 + per_pair * (10 + 10)
    assert step_flops(plan, (per_token, per_sample, per_pair)) == pytest.approx(expected)


def clocked(tmp_path, clock=CLOCK):
    inner = ProfiledCostModel.load(write_fit(tmp_path), block_size=16)
    return ClockedCostModel(inner, clock, load_model("llama-3.1-8b"))


def test_the_clocked_model_times_a_light_step_after_idle_as_profiled(tmp_path):
    model = clocked(tmp_path)
    plan = plan_of([(99, 1, True)])                    # a few GFLOP: far below the knee
    assert model.predict(plan) == pytest.approx(model.inner.predict(plan))


def test_a_heavy_step_after_idle_runs_faster_than_the_profile_timed_it_at_its_settling_clock(
        tmp_path):
    model = clocked(tmp_path)
    plan = plan_of([(0, 512, False)])
    profiled = model.inner.forward_seconds(plan)
    full, settling = model.full_clock(profiled, step_flops(plan, model.counts))
    assert settling < CLOCK.max_mhz
    assert full == pytest.approx(profiled / CLOCK.slowdown(settling), rel=1e-3)
    assert full <= model.predict(plan) - model.inner.around_seconds(plan) < profiled


def test_the_clocked_model_keeps_the_profiles_other_terms_and_names_itself(tmp_path):
    model = clocked(tmp_path)
    assert model.name.endswith("+clock")
    assert model.block_size == 16                     # the profile's attributes show through
    assert model.describe()["clock"]["sensitivity"] == 0.5
    assert pickle.loads(pickle.dumps(model)).name == model.name


def test_the_clocked_model_reads_every_profiled_time_at_its_settling_clock(tmp_path):
    model = clocked(tmp_path)
    assert model.describe()["clock"]["full_clock_times"] == "profiled times at each settling clock"
    plan = plan_of([(99, 1, True)])                    # light: its settling clock is the top
    model.reset()
    assert model.predict(plan) == pytest.approx(model.inner.forward_seconds(plan)
                                                + model.inner.around_seconds(plan), rel=1e-6)


def write_clock(directory: Path, **params) -> Path:
    values = dict(CLOCK.to_dict(), **params)
    path = directory / CLOCK_FILE
    path.write_text(json.dumps({"format": "simkv-clock-1", "params": values}))
    return path


def test_a_clock_file_with_a_bad_value_names_the_file_and_key(tmp_path):
    path = write_clock(tmp_path, tau_up_s="fast")
    with pytest.raises(InputError, match=r"clock.json: params.tau_up_s"):
        ClockModel.load(path)


def test_a_clock_file_with_a_floor_above_the_top_is_refused(tmp_path):
    with pytest.raises(InputError, match="min_mhz <= max_mhz"):
        ClockModel.load(write_clock(tmp_path, min_mhz=2100.0))


def scenario(**top):
    return load_scenario(ROOT / "scenarios" / "quickstart.yaml", top)


def test_the_bundled_h200_profile_runs_under_its_clock_model_unless_the_clock_is_fixed():
    assert (PROFILE / CLOCK_FILE).is_file()
    assert isinstance(load_cost_model(scenario()), ClockedCostModel)
    assert isinstance(load_cost_model(scenario(gpu_clock="fixed")), ProfiledCostModel)


def test_an_unknown_gpu_clock_setting_is_refused():
    with pytest.raises(InputError, match="gpu_clock: 'slow' is not one of auto, fixed"):
        scenario(gpu_clock="slow")


def long_prompts(num_requests: int, rate: float, prompt: int, output: int):
    """Quickstart with fixed prompt and output lengths."""
    return load_scenario(ROOT / "scenarios" / "quickstart.yaml", {
        "workload.synthetic.num_requests": num_requests,
        "workload.synthetic.arrival.rate": rate,
        "workload.synthetic.prompt_tokens": {"dist": "fixed", "value": prompt},
        "workload.synthetic.output_tokens": {"dist": "fixed", "value": output}})


def test_a_second_simulation_with_one_clocked_model_starts_on_a_rested_gpu():
    from simkv.sim.engine import simulate
    # long prompts, one output token: the run ends on a prefill, with the clock down
    scn = long_prompts(12, 100.0, 6000, 1)
    model = load_cost_model(scn)
    first = simulate(scn, cost_model=model).summary
    assert model.state.mhz < model.clock.max_mhz
    second = simulate(scn, cost_model=model).summary
    assert first["ttft_s"] == second["ttft_s"]


def test_long_prompts_arriving_apart_prefill_faster_than_the_profile_timed_them():
    # each prefill starts on a rested GPU: near full clock, not at its settling clock
    from simkv.sim.engine import simulate
    scn = long_prompts(10, 0.5, 4000, 4)
    clocked_ttft = simulate(scn).summary["ttft_s"]["mean"]
    fixed = load_scenario(scn.raw, {"gpu_clock": "fixed"})
    fixed_ttft = simulate(fixed).summary["ttft_s"]["mean"]
    assert clocked_ttft < fixed_ttft * 0.97


def test_the_committed_clock_model_refits_from_its_committed_probe():
    from simkv.fitting.clock import fit_clock
    committed = json.loads((PROFILE / CLOCK_FILE).read_text())
    probes = [ROOT / p for p in committed["fit"]["probes"]]
    assert len(probes) == 3                            # three leases of the GPU
    refit = fit_clock(probes, load_model("llama-3.1-8b"))
    for key, value in committed["params"].items():
        assert math.isclose(refit["params"][key], value, rel_tol=1e-9), key
    fit = refit["fit"]
    assert fit["held_out_rms_log_error"] < fit["held_out_rms_log_error_clock_blind"]
    # reading the profile at each composition's settling clock is closer to what the profiler's
    # grid measured than reading it as full-clock times
    state = fit["profile_state"]
    assert state["mean_abs_error"] < state["mean_abs_error_as_measured"]


def test_a_probe_folder_without_its_metadata_is_refused_naming_the_file(tmp_path):
    from simkv.fitting.clock import read_probe
    source = PROFILE / "probes" / "clock"
    for name in ("steps.csv", "smi.csv"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(InputError, match="meta.json: needs t0_unix and compositions"):
        read_probe(tmp_path)
