"""Which rate to plan with: one workload's own rate, or over replicates a low quantile of the
workloads' rates (not the mean's interval), with the headline inside the workloads' spread."""
import json

import pytest

import simkv
from simkv.whatif.capacity import PLANNING_QUANTILE, find_capacity, planning_rate
from simkv.whatif.commands import capacity_command
from tests.test_capacity import TINY


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("planning") / "tiny.yaml"
    path.write_text(TINY)
    return path


def test_the_planning_rate_is_the_ten_percent_quantile_of_the_workloads():
    assert PLANNING_QUANTILE == 0.1
    # five workloads: 10% lies 0.4 of the way from the lowest to the next
    assert planning_rate([30.0, 10.0, 50.0, 20.0, 40.0]) == pytest.approx(14.0)


def test_one_workload_plans_with_its_own_rate_and_says_how_to_see_the_spread(tiny):
    seen = []
    result = find_capacity(simkv.load_scenario(tiny), tolerance=0.05, on_progress=seen.append)
    assert result.planning_rate_rps == result.max_rate_rps
    assert "--replicates" in result.planning()["basis"]
    assert len(seen) == len(result.probes) and seen[0].startswith("simulation 1: ")


def test_replicates_plan_below_the_spread_that_holds_the_headline(tiny, capsys):
    assert capacity_command(tiny, [], replicates=3, tolerance=0.05, as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    ci, plan = data["ci"], data["planning"]
    assert ci["min"] <= data["max_rate_rps"] <= ci["max"]
    assert plan["rate_rps"] == data["planning_rate_rps"] == pytest.approx(
        planning_rate(ci["replicates"]))
    assert ci["min"] <= plan["rate_rps"] < ci["mean"]
    assert plan["workloads"] == 3 and plan["quantile"] == 0.1


def test_the_command_ends_with_the_rate_to_plan_with(tiny, capsys):
    assert capacity_command(tiny, [], tolerance=0.05) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("plan with ") and "requests/s" in last


def test_the_mean_interval_uses_students_t_for_any_number_of_workloads():
    from simkv.whatif.capacity import confidence_interval
    two = confidence_interval([10.0, 12.0])          # t(0.975, 1) = 12.706: 12.706 * sqrt(2)/sqrt(2)
    assert (two["low"], two["high"]) == pytest.approx((11.0 - 12.7062, 11.0 + 12.7062), abs=1e-3)
    many = confidence_interval([float(i % 2) for i in range(40)])   # t(0.975, 39) = 2.0227
    half = 2.0227 * many["std"] / 40 ** 0.5
    assert many["high"] - many["mean"] == pytest.approx(half, rel=1e-4)
