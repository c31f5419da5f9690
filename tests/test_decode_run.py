"""Decode runs (simkv.engine.decode_run) give exactly the step-by-step results.

Every scenario in scenarios/ (a window of its first requests; the shared traces skip cleanly
where absent) and Hypothesis-generated ones, on the roofline model (timed step by step from
`plan_at`) and the profiled H200 model with its effects (timed in closed form), run twice:
with `exact=True` and with decode runs. summary.json (but wall time), requests.csv and
steps.csv must be the same bytes. The whole shared traces are compared by
`benchmarks/sim_speed.py --in-process 1` (and `--scenario mooncake-memory|running-1024`).
"""
import json
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import simkv
import simkv.engine.decode_run as decode_run_module
from simkv.config.scenario import load_scenario, with_overrides
from simkv.engine.loop import delay_to, hops
from simkv.engine.results import csv_text
from simkv.errors import InputError
from simkv.sim.engine import Simulation
from tests.test_fuzz import EXAMPLES, scenarios as fuzz_scenarios

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "scenarios").rglob("*.yaml"))
WINDOW = 400          # requests of each bundled scenario


class RunCount:
    """Count the decode runs committed and the steps they covered."""

    def __init__(self):
        self.runs = self.steps = 0

    def __enter__(self):
        self.commit = decode_run_module.DecodeRun.commit
        count = self

        def commit(run, ends, recorder):
            count.runs += 1
            count.steps += len(ends) - 1
            return count.commit(run, ends, recorder)
        decode_run_module.DecodeRun.commit = commit
        return self

    def __exit__(self, *exc):
        decode_run_module.DecodeRun.commit = self.commit
        return False


def outputs(scenario, exact: bool, trace_df=None) -> tuple:
    """(summary.json text without wall time, requests.csv text, steps.csv text)."""
    result = Simulation(scenario, trace_df, exact=exact).run()
    summary = dict(result.summary)
    summary.pop("wall_time_s")
    return (json.dumps(summary, indent=2), csv_text(result.requests), csv_text(result.steps))


def assert_identical(scenario, trace_df=None) -> RunCount:
    exact = outputs(scenario, True, trace_df)
    with RunCount() as count:
        fast = outputs(scenario, False, trace_df)
    for name, a, b in zip(("summary.json", "requests.csv", "steps.csv"), exact, fast):
        if a != b:
            diff = next(i for i, (x, y) in enumerate(zip(a.splitlines(), b.splitlines()))
                        if x != y) if a.splitlines() != b.splitlines() else -1
            line_a = a.splitlines()[diff] if diff >= 0 else ""
            line_b = b.splitlines()[diff] if diff >= 0 else ""
            pytest.fail(f"{scenario.name}: {name} differs at line {diff + 1}:\n"
                        f"  exact: {line_a}\n  runs:  {line_b}")
    return count


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: str(p.relative_to(ROOT / "scenarios")))
def test_every_bundled_scenario_gives_the_same_bytes_with_decode_runs(path):
    try:
        scenario = with_overrides(load_scenario(path), {"workload.limit": WINDOW})
    except InputError as exc:
        if "trace" in str(exc) and ("not found" in str(exc) or "No such" in str(exc)):
            pytest.skip(f"shared trace absent: {exc}")
        raise
    count = assert_identical(scenario)
    # a model with KV cache groups plans every step on its own (simkv.engine.kv.groups)
    if scenario.cache.allocator == "paged" and not scenario.model.is_hybrid:
        assert count.runs > 0, "no decode run was taken: the comparison would be vacuous"


def test_most_steps_of_the_quickstart_are_taken_in_runs():
    scenario = load_scenario(ROOT / "scenarios" / "quickstart.yaml")
    count = assert_identical(scenario)
    steps = Simulation(scenario).run().summary["num_steps"]
    assert count.steps > 0.5 * steps, (count.steps, steps)


@st.composite
def run_scenarios(draw):
    """The fuzz test's scenarios, half of them on the profiled model (the closed form)."""
    raw = draw(fuzz_scenarios())
    if draw(st.booleans()):
        raw["cost_model"] = "auto"
        raw["gpu"] = "h200"
    return raw


@settings(max_examples=max(20, EXAMPLES // 2), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(raw=run_scenarios())
def test_generated_scenarios_give_the_same_bytes_with_decode_runs(raw):
    assert_identical(simkv.load_scenario(raw))


@st.composite
def conversation_scenarios(draw):
    """run_scenarios with conversations (simkv.workload.synthetic): later turns that arrive
    while the turn before still decodes, or after it finished, and hit its blocks; under
    either semantics (vllm-0.26 indexes duplicate blocks)."""
    raw = draw(run_scenarios())
    raw["semantics"] = draw(st.sampled_from(["vllm-0.26", "vllm-0.18"]))
    raw["workload"]["synthetic"]["conversation"] = {
        "turns": {"dist": "uniform", "min": 1, "max": draw(st.sampled_from([2, 4]))},
        "think_time_s": {"dist": "exponential",
                         "mean": draw(st.sampled_from([0.005, 0.05, 0.5]))},
        "new_tokens": {"dist": "uniform", "min": 1, "max": draw(st.sampled_from([4, 16]))}}
    return raw


@settings(max_examples=max(20, EXAMPLES // 2), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(raw=conversation_scenarios())
def test_generated_conversations_give_the_same_bytes_with_decode_runs(raw):
    assert_identical(simkv.load_scenario(raw))


@pytest.mark.parametrize("semantics", ["vllm-0.26", "vllm-0.18"])
def test_a_chat_workload_on_a_tight_pool_gives_the_same_bytes_with_decode_runs(semantics):
    """Turns that wait for blocks while the turn they continue decodes (the guard holds runs
    back), preemptions, and runs between them."""
    scenario = simkv.load_scenario({
        "name": "chat", "model": "llama-3.1-8b", "gpu": "h200", "cost_model": "auto",
        "seed": 0, "semantics": semantics,
        "cache": {"block_size": 16, "num_gpu_blocks_override": 400},
        "scheduler": {"max_num_seqs": 32, "max_model_len": 4096},
        "workload": {"synthetic": {
            "num_requests": 60, "arrival": {"process": "poisson", "rate": 4},
            "prompt_tokens": {"dist": "lognormal", "mean": 600, "sigma": 0.6, "max": 2000},
            "output_tokens": {"dist": "uniform", "min": 20, "max": 300},
            "shared_prefix": {"num_groups": 2, "prefix_tokens": 256, "fraction": 0.5},
            "conversation": {"turns": {"dist": "uniform", "min": 1, "max": 4},
                             "think_time_s": {"dist": "exponential", "mean": 2.0},
                             "new_tokens": {"dist": "uniform", "min": 10, "max": 200}}}}})
    count = assert_identical(scenario)
    assert count.runs > 0


def test_a_delay_that_no_float_sum_reaches_is_taken_in_two_hops():
    # now + d rounds half to even: from this clock no delay lands on this target
    now, target = 0.03907152666795021, 0.1120897911527987
    assert delay_to(now, target) is None
    middle = 0.09
    ends = [now, middle, target]
    clock = now
    for delay in hops(ends):
        clock = clock + delay
    assert clock == target


def test_hops_land_exactly_on_every_end_of_a_long_run():
    ends, clock = [1234.5678], 1234.5678
    for k in range(1, 200):
        clock = clock + 0.01 * (1 + math.sin(k))
        ends.append(clock)
    for start in range(0, 199, 7):
        c = ends[start]
        for delay in hops(ends[start:]):
            c = c + delay
        assert c == ends[-1]


def test_a_run_plans_each_step_as_the_scheduler_would():
    """Every step of every run, as `plan_at` gives it to a cost model without a closed form,
    equals the scheduler's own plan of that step (items, counts and state snapshot)."""
    from simkv.engine.decode_run import DecodeRun
    scenario = with_overrides(load_scenario(ROOT / "scenarios" / "quickstart.yaml"),
                              {"workload.limit": 150})
    seen = {}

    def fields(plan):
        return ([(item.seq.seq_id, item.start, item.num_tokens, item.is_decode)
                 for item in plan.scheduled], plan.num_decode_tokens, plan.decode_context_tokens,
                plan.decode_max_context, plan.num_running, plan.num_waiting,
                plan.kv_blocks_used, plan.kv_blocks_free)

    commit = DecodeRun.commit

    def record(run, ends, recorder):
        for k in range(1, len(ends)):
            seen[run.plan.step + k - 1] = fields(run.plan_at(k, ends[k - 1]))
        return commit(run, ends, recorder)
    DecodeRun.commit = record
    try:
        Simulation(scenario).run()
    finally:
        DecodeRun.commit = commit
    exact = Simulation(scenario, exact=True)
    schedule = exact.scheduler.schedule
    planned = {}

    def keep(now):
        plan = schedule(now)
        planned[plan.step] = fields(plan)
        return plan
    exact.scheduler.schedule = keep
    exact.run()
    assert len(seen) > 100
    for step, got in seen.items():
        assert got == planned[step], step
