"""`simkv capacity`: the SLO rule, the search's guarantee, replicates and the command's JSON."""
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import simkv
from simkv.errors import InputError
from simkv.whatif.capacity import block_bootstrap, find_capacity, judge_slo
from simkv.whatif.commands import capacity_command

TINY = """\
name: tiny
model: llama-3.1-8b
gpu: h200
cache: {block_size: 16, memory_budget_gib: 24}
scheduler: {max_model_len: 4096}
workload:
  synthetic: {num_requests: 120, arrival: {process: poisson, rate: 10},
              prompt_tokens: {dist: lognormal, mean: 800, sigma: 0.8, max: 3000},
              output_tokens: {dist: fixed, value: 40}}
slo: {ttft_s: 0.3, tpot_s: 0.05}
"""


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def requests(ttft, tpot=None, status=None) -> pd.DataFrame:
    count = len(ttft)
    return pd.DataFrame({"ttft_s": ttft, "tpot_s": tpot or [0.01] * count,
                         "e2e_s": [1.0] * count, "status": status or ["completed"] * count})


def test_per_request_slos_need_90_percent_of_requests_meeting_all_of_them():
    nine_of_ten = requests([0.1] * 9 + [2.0])
    eight_of_ten = requests([0.1] * 8 + [2.0] * 2)
    assert judge_slo({}, nine_of_ten, {"ttft_s": 1.0}).met
    verdict = judge_slo({}, eight_of_ten, {"ttft_s": 1.0})
    assert not verdict.met and verdict.attainment == 0.8


def test_a_request_must_meet_every_per_request_slo_at_once():
    # 9 of 10 meet TTFT and 9 of 10 meet TPOT, but only 8 meet both
    df = requests([0.1] * 9 + [2.0], tpot=[0.5] + [0.01] * 9)
    assert not judge_slo({}, df, {"ttft_s": 1.0, "tpot_s": 0.1}).met


def test_rejected_requests_count_as_misses_and_cancelled_ones_do_not_count():
    rejected = requests([0.1] * 9 + [math.nan], status=["completed"] * 9 + ["rejected"])
    cancelled = requests([0.1] * 8 + [math.nan] * 2,
                         status=["completed"] * 8 + ["cancelled"] * 2)
    assert judge_slo({}, rejected, {"ttft_s": 1.0}).attainment == 0.9
    assert judge_slo({}, cancelled, {"ttft_s": 1.0}).attainment == 1.0


def test_percentile_slos_bound_the_summary_figure():
    summary = {"ttft_s": {"mean": 0.2, "p50": 0.1, "p90": 0.4, "p99": 0.9}}
    assert judge_slo(summary, requests([0.1]), {"ttft_p90_s": 0.5}).met
    verdict = judge_slo(summary, requests([0.1]), {"ttft_p99_s": 0.5})
    assert not verdict.met and verdict.failures == [("ttft_p99_s", 0.5, 0.9)]


def at_scale(path: Path, time_scale: float):
    """Judge the scenario as `simkv run --set workload.time_scale=...` would run it."""
    scenario = simkv.load_scenario(path, {"workload.time_scale": time_scale})
    result = simkv.simulate(scenario)
    return judge_slo(result.summary, result.requests, scenario.slo)


def test_slos_hold_at_the_returned_rate_and_fail_ten_percent_above(tiny):
    result = find_capacity(simkv.load_scenario(tiny), tolerance=0.02)
    assert result.max_rate_rps > 0
    assert at_scale(tiny, result.rate_scale).met
    assert not at_scale(tiny, result.rate_scale / 1.1).met
    passing = [rate for rate, met in result.probes if met]
    failing = [rate for rate, met in result.probes if not met and rate > result.max_rate_rps]
    assert max(passing) == result.max_rate_rps
    assert min(failing) / result.max_rate_rps - 1 <= 0.1 + 1e-9


def test_replicates_give_a_confidence_interval(tiny):
    result = find_capacity(simkv.load_scenario(tiny), tolerance=0.05, replicates=3, workers=2)
    ci = result.ci
    assert len(ci["replicates"]) == 3 and ci["replicates"][0] == result.max_rate_rps
    assert ci["low"] <= ci["mean"] <= ci["high"]
    assert len(set(ci["replicates"])) > 1, "reseeded workloads should give different rates"


def test_block_bootstrap_keeps_the_count_and_ordered_arrivals():
    frame = pd.DataFrame({"request_id": range(100), "arrival_s": np.arange(100) * 0.5,
                          "prompt_tokens": range(1, 101)})
    out = block_bootstrap(frame, np.random.default_rng(1))
    assert len(out) == 100 and out["arrival_s"].iloc[0] == 0.0
    assert out["arrival_s"].is_monotonic_increasing
    assert list(out["request_id"]) == list(range(100))
    # drawn in runs of 10 consecutive requests
    assert (np.diff(out["prompt_tokens"].to_numpy()[:10]) == 1).all()


def test_capacity_command_prints_the_interface_json_keys(tiny, capsys):
    assert capacity_command(tiny, ["slo.ttft_s=0.5"], replicates=1, tolerance=0.05,
                            as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"max_rate_rps", "rate_scale", "slo", "summary"} <= set(data)
    assert data["slo"] == {"ttft_s": 0.5, "tpot_s": 0.05}
    assert data["verified"]["at_rate"]["met"] and not data["verified"]["above"]["met"]
    assert data["summary"]["requests_total"] == 120


def test_a_scenario_without_slos_is_bad_input(tiny):
    text = tiny.read_text().replace("slo: {ttft_s: 0.3, tpot_s: 0.05}\n", "")
    tiny.write_text(text)
    with pytest.raises(InputError, match="sets no SLOs"):
        capacity_command(tiny, [], replicates=1, tolerance=0.02, as_json=True)


def test_a_tolerance_of_ten_percent_or_more_is_bad_input(tiny):
    with pytest.raises(InputError, match="--tolerance"):
        capacity_command(tiny, [], replicates=1, tolerance=0.1, as_json=True)


def test_replicates_of_a_trace_scenario_resolve_its_trace_next_to_the_file(tmp_path, monkeypatch):
    folder = tmp_path / "scenarios"
    folder.mkdir()
    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(0.1, 100))
    pd.DataFrame({"arrival_s": arrivals - arrivals[0],
                  "prompt_tokens": rng.integers(200, 1500, 100),
                  "output_tokens": 40}).to_csv(folder / "trace.csv", index=False)
    text = TINY.split("workload:")[0] + "workload: {trace: trace.csv}\nslo: {ttft_s: 0.3}\n"
    (folder / "t.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)   # the trace path is relative to the scenario, not to here
    result = find_capacity(simkv.load_scenario("scenarios/t.yaml"), tolerance=0.05,
                           replicates=2, workers=2)
    assert result.max_rate_rps > 0 and len(result.ci["replicates"]) == 2
    assert result.ci["replicates"][0] != result.ci["replicates"][1]   # a bootstrap resample
