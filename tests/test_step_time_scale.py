"""`step_time_scale`: every predicted step time times a factor (another GPU of the same kind)."""
import subprocess
import sys
from pathlib import Path

import pytest

from simkv.config.scenario import load_scenario
from simkv.costmodel import load_cost_model
from simkv.errors import InputError
from simkv.sim.engine import simulate
from tests.test_profiled_costmodel import plan_of

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "scenarios" / "quickstart.yaml"


def scenario(**overrides):
    return load_scenario(QUICKSTART, overrides)


def test_the_scale_multiplies_every_prediction_and_names_itself():
    assert scenario().step_time_scale == 1.0
    # with the clock fixed, exactly; under the clock state a step 5% longer lets the clock move
    # a little further while it runs
    for clock, rel in (("fixed", 1e-12), ("auto", 1e-3)):
        plain = load_cost_model(scenario(gpu_clock=clock))
        slower = load_cost_model(scenario(gpu_clock=clock, step_time_scale=1.05))
        assert slower.name == f"{plain.name}*1.05"
        for items in ([(1023, 1, True)] * 8, [(0, 512, False)], [(0, 256, False), (511, 1, True)]):
            for model in (plain, slower):
                if hasattr(model, "reset"):          # the clock state starts at full clock
                    model.reset()
            plan = plan_of(items)
            assert slower.predict(plan) == pytest.approx(1.05 * plain.predict(plan), rel=rel)
        assert slower.describe()["step_time_scale"] == 1.05
        assert slower.block_size == plain.block_size          # the inner model shows through


def test_twice_the_step_times_serve_requests_at_zero_in_twice_the_time():
    # all arrivals at t = 0 and no cancellations: the schedule does not depend on the clock
    base = {"workload.synthetic.num_requests": 40, "workload.synthetic.arrival.rate": 1e9,
            "gpu_clock": "fixed"}
    once = simulate(scenario(**base)).summary
    twice = simulate(scenario(**base, step_time_scale=2)).summary
    assert twice["sim_duration_s"] == pytest.approx(2 * once["sim_duration_s"], rel=1e-9)
    assert twice["ttft_s"]["mean"] == pytest.approx(2 * once["ttft_s"]["mean"], rel=1e-6)
    assert twice["cost_model"].endswith("*2")


def test_under_the_clock_state_the_scale_stretches_the_steps_not_the_gaps_between_them():
    # scaled from outside, the clock model would take each step's stretch for idle time and
    # come back to full clock between steps that run back to back (1.956x instead of 2x)
    base = {"workload.synthetic.num_requests": 200, "workload.synthetic.arrival.rate": 1e9}
    once = simulate(scenario(**base)).summary
    twice = simulate(scenario(**base, step_time_scale=2)).summary
    assert twice["cost_model"].endswith("+clock*2")
    assert twice["sim_duration_s"] == pytest.approx(2 * once["sim_duration_s"], rel=0.002)


def test_the_host_term_the_diagnostics_read_is_scaled_too():
    plan = plan_of([(1023, 1, True)] * 8)
    for clock in ("auto", "fixed"):
        plain = load_cost_model(scenario(gpu_clock=clock))
        slower = load_cost_model(scenario(gpu_clock=clock, step_time_scale=1.5))
        assert slower.host_seconds(plan) == pytest.approx(1.5 * plain.host_seconds(plan))


@pytest.mark.parametrize("value", [0, -1, "fast", True])
def test_a_scale_that_is_not_a_positive_number_is_refused(value):
    with pytest.raises(InputError, match="step_time_scale"):
        scenario(step_time_scale=value)


def test_the_command_line_refuses_a_zero_scale_in_one_line():
    run = subprocess.run([sys.executable, "-m", "simkv.cli", "run", str(QUICKSTART), "--set",
                          "step_time_scale=0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("error: ") and "step_time_scale" in run.stderr
    assert run.stderr.count("\n") == 1
