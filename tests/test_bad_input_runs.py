"""Bad input never hangs, lies or crashes (issue 29): runs that go on, and where they stop.

Input changed instead of refused is said (warnings on stderr and in summary.json, with
counts); a failing run prints only its one error line; each numeric key at its largest
accepted value runs on a tiny workload or is refused; a loop that makes no progress stops
with one error (a bound from the workload, not the wall clock); the prefix-cache hit ratio
splits into cross-request reuse and self re-hits.
"""
from __future__ import annotations

import json
import math

import pytest

import simkv
from simkv.cli import run_cli
from simkv.engine.loop import StepGuard
from simkv.errors import InputError
from simkv.limits import MAX_BLOCKS, RULES, rule_for
from simkv.sim.engine import simulate
from tests.test_bad_input import BASE, SYNTHETIC, nested, scenario_keys, write

TINY_POOL = {"cache": {"num_gpu_blocks_override": 512},
             "scheduler": {"max_model_len": 2048}}


def run(argv, tmp_path, capsys, monkeypatch) -> tuple:
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = run_cli([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- warnings for input changed instead of refused --------------------------------------------

AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:48.0000000,32,4\n"
         "2023-11-16 18:15:49.0000000,40,0\n"        # empty output: dropped
         "2023-11-16 18:15:47.0000000,24,3\n"        # out of order: sorted
         "2023-11-16 18:15:50.0000000,0,5\n")        # empty prompt: dropped


def test_dropped_rows_and_resorted_arrivals_are_warned_on_stderr_and_in_the_summary(
        tmp_path, capsys, monkeypatch):
    write(tmp_path, "a.csv", AZURE)
    scenario = write(tmp_path, "s.yaml", {"model": "llama-3.1-8b",
                                          "workload": {"trace": "a.csv"}})
    code, out, err = run(["run", scenario, "--out", "out", "--json"], tmp_path, capsys,
                         monkeypatch)
    assert code == 0, err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["requests_total"] == 2 and summary["requests_dropped"] == 2
    assert summary["warnings"] == [
        "dropped 1 trace row(s): empty prompt (ContextTokens == 0)",
        "dropped 1 trace row(s): empty output (GeneratedTokens == 0)",
        "1 request(s) arrived out of order; sorted by arrival"]
    assert err.splitlines() == [f"warning: {w}" for w in summary["warnings"]]


def test_capped_outputs_are_warned_with_their_count(tmp_path, capsys, monkeypatch):
    spec = {**SYNTHETIC, "output_tokens": {"dist": "fixed", "value": 5000}}
    scenario = write(tmp_path, "s.yaml", {"model": "llama-3.1-8b", "semantics": "vllm-0.26",
                                          "scheduler": {"max_model_len": 1024,
                                                        "cap_output_tokens": True},
                                          "workload": {"synthetic": spec}})
    code, out, err = run(["run", scenario, "--out", "out", "--json"], tmp_path, capsys,
                         monkeypatch)
    assert code == 0, err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["requests_capped"] == 3
    assert summary["warnings"] == ["3 request(s) asked for more output than max_model_len "
                                   "leaves them; their outputs were capped"]
    assert err.splitlines() == ["warning: " + summary["warnings"][0]]


def test_a_clean_run_warns_nothing_and_shows_no_progress_off_a_terminal(
        tmp_path, capsys, monkeypatch):
    scenario = write(tmp_path, "s.yaml", BASE)
    code, out, err = run(["run", scenario, "--out", "out"], tmp_path, capsys, monkeypatch)
    assert code == 0 and err == ""
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["warnings"] == []


def test_a_failing_run_prints_only_its_error_even_when_its_trace_would_warn(
        tmp_path, capsys, monkeypatch):
    write(tmp_path, "a.csv", AZURE)
    scenario = write(tmp_path, "s.yaml", {"model": "llama-3.1-8b", "seed": -1,
                                          "workload": {"trace": "a.csv"}})
    code, out, err = run(["run", scenario, "--out", "out"], tmp_path, capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ")
    assert not (tmp_path / "out").exists()


# --- sweep validates the workload before any point ---------------------------------------------

def test_sweep_refuses_a_bad_trace_row_before_running_a_point(tmp_path, capsys, monkeypatch):
    write(tmp_path, "t.csv", "arrival_s,prompt_tokens,output_tokens\n0,32,4\n1,x,4\n")
    scenario = write(tmp_path, "s.yaml", {"model": "llama-3.1-8b",
                                          "workload": {"trace": "t.csv"}})
    code, out, err = run(["sweep", scenario, "--grid", "cache.block_size=16,32", "--out",
                          "sw"], tmp_path, capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and "t.csv: line 3" in err
    assert not (tmp_path / "sw").exists()


def test_sweep_checks_each_distinct_workload_of_the_grid(tmp_path, capsys, monkeypatch):
    # the first point's workload is fine; limit 0 at the second point is not
    scenario = write(tmp_path, "s.yaml", BASE)
    code, out, err = run(["sweep", scenario, "--grid", "workload.limit=2,0", "--out", "sw"],
                         tmp_path, capsys, monkeypatch)
    assert code == 2 and "workload.limit=0" in err and "workload.limit" in err
    assert not (tmp_path / "sw").exists()


# --- the largest accepted value of every numeric key -------------------------------------------

def largest(rule):
    """The rule's largest accepted value (below an open upper end, its closest float)."""
    if rule.high_open:
        return math.nextafter(rule.high, -math.inf) if rule.kind is float else \
            int(rule.high) - 1
    return int(rule.high) if rule.kind is int else float(rule.high)


def at_largest(key: str) -> dict:
    """A tiny scenario with `key` at its largest accepted value (the siblings a key needs)."""
    rule = rule_for(key) or RULES.get(key) or RULES["n" if key.endswith(".n") else "lengths"]
    scn = nested(key, largest(rule))
    for section, values in TINY_POOL.items():
        scn.setdefault(section, {})
        for k, v in values.items():
            scn[section].setdefault(k, v)
    if key.startswith("workload.synthetic.") and key != "workload.synthetic.num_requests":
        scn.setdefault("workload", {})["limit"] = 3
    if key.startswith("workload.synthetic.num_requests"):
        scn["workload"]["limit"] = 3
    if key == "workload.synthetic.duration_s":
        del scn["workload"]["synthetic"]["num_requests"]
    return scn


LARGEST_KEYS = scenario_keys() + ["workload.synthetic.duration_s"]


@pytest.mark.parametrize("key", LARGEST_KEYS)
def test_each_numeric_key_at_its_largest_value_runs_or_is_refused(key, tmp_path, capsys,
                                                                   monkeypatch):
    scenario = write(tmp_path, "s.yaml", at_largest(key))
    code, out, err = run(["run", scenario, "--out", "out", "--json"], tmp_path, capsys,
                         monkeypatch)
    assert code in (0, 2), err
    if code == 2:
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    else:
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        assert summary["leaked_blocks"] == 0
    if key == "cache.num_gpu_blocks_override":      # the most blocks the simulator holds
        assert code == 0 and summary["num_blocks"] == MAX_BLOCKS

# --- the guard against loops without progress ---------------------------------------------------

def test_a_loop_that_makes_no_progress_stops_with_one_error(monkeypatch):
    scn = simkv.load_scenario(BASE)
    # every step's outputs are thrown away, so the requests never advance: a stand-in for any
    # future bug that makes the loop spin
    from simkv.engine.scheduler import Scheduler
    monkeypatch.setattr(Scheduler, "finish_step", lambda self, plan, outputs, now: None)
    monkeypatch.setattr(StepGuard, "BASE", 100)     # a short run to the bound
    with pytest.raises(InputError, match="the bound for this workload"):
        simulate(scn, exact=True)


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -1.0])
def test_a_step_of_no_finite_length_is_refused(seconds):
    guard = StepGuard([], "s.yaml")
    with pytest.raises(InputError, match=r"s\.yaml: step 1: the cost model predicts"):
        guard.check(seconds)


def test_the_step_bound_grows_with_the_work_the_requests_ask_for():
    request = type("R", (), {"n": 2, "prompt_tokens": 10, "output_tokens": 5})()
    one, two = StepGuard([request], "s"), StepGuard([request, request], "s")
    assert two.max_delays - one.max_delays == StepGuard.STEPS_PER_TOKEN * 30 \
        + StepGuard.STEPS_PER_REQUEST


# --- prefix-cache hits: cross-request reuse and self re-hits -----------------------------------

def preempting(enable_prefix_caching=True, blocks=40):
    """Long outputs in a tight pool: recompute preemptions re-admit requests whose own blocks
    are still cached."""
    return {"model": "llama-3.1-8b", "semantics": "vllm-0.18",
            "cache": {"num_gpu_blocks_override": blocks,
                      "enable_prefix_caching": enable_prefix_caching},
            "scheduler": {"max_model_len": 512, "max_num_seqs": 8},
            "workload": {"synthetic": {"num_requests": 8,
                                       "arrival": {"process": "fixed", "rate": 100},
                                       "prompt_tokens": {"dist": "fixed", "value": 64},
                                       "output_tokens": {"dist": "fixed", "value": 200}}}}


def test_self_rehits_and_cross_request_hits_sum_to_the_headline_ratio():
    s = simulate(simkv.load_scenario(preempting())).summary
    assert s["preemptions"] > 0
    assert s["prefix_cache_self_rehit_ratio"] > 0
    assert s["prefix_cache_cross_request_hit_ratio"] + s["prefix_cache_self_rehit_ratio"] \
        == pytest.approx(s["prefix_cache_hit_ratio"], rel=1e-12)


def test_without_preemptions_every_hit_is_cross_request():
    scn = preempting(blocks=4096)
    scn["workload"]["synthetic"]["shared_prefix"] = {"num_groups": 1, "prefix_tokens": 32,
                                                     "fraction": 1.0}
    s = simulate(simkv.load_scenario(scn)).summary
    assert s["preemptions"] == 0 and s["prefix_cache_hit_ratio"] > 0
    assert s["prefix_cache_self_rehit_ratio"] == 0.0
    assert s["prefix_cache_cross_request_hit_ratio"] == s["prefix_cache_hit_ratio"]


def test_without_prefix_caching_both_parts_are_zero():
    s = simulate(simkv.load_scenario(preempting(enable_prefix_caching=False))).summary
    assert s["preemptions"] > 0
    assert s["prefix_cache_cross_request_hit_ratio"] == s["prefix_cache_self_rehit_ratio"] == 0
