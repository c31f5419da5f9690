"""One simulated step, explained: its plan and the cost model's terms (`simkv explain`)."""
from __future__ import annotations

import math

from simkv.errors import InputError
from simkv.sim.engine import Simulation

PLAN_COUNTS = ("num_prefill_tokens", "num_decode_tokens", "num_prefill_seqs",
               "decode_context_tokens", "decode_max_context", "decode_shared_context_tokens",
               "decode_shared_block_tokens", "prefill_context_tokens", "prefill_attention_pairs",
               "num_running", "num_waiting", "kv_blocks_used", "kv_blocks_free")


class _Found(Exception):
    """Ends the simulation once the step asked for has been costed."""


def plan_dict(plan) -> dict:
    """A step plan as plain data: its counts, the scheduled items and the memory operations."""
    out = {"plan_number": plan.step, "start_s": plan.now_s,
           "num_decode_seqs": plan.num_decode_seqs}
    out.update({key: getattr(plan, key) for key in PLAN_COUNTS})
    out["scheduled"] = [{"request_id": item.seq.request.request_id, "sample": item.seq.sample,
                         "start": item.start, "num_tokens": item.num_tokens,
                         "decode": item.is_decode} for item in plan.scheduled]
    out.update({"block_copies": len(plan.block_copies), "swap_out_blocks": len(plan.swap_out),
                "swap_in_blocks": len(plan.swap_in), "preempted": list(plan.preempted)})
    return out


def explain_step(scenario, step: int) -> dict:
    """`{step, plan, terms: {name: seconds}, seconds, cost_model}` of the `step`-th executed step
    (steps.csv's `step` column) of the scenario's simulation; `seconds == math.fsum(terms.values())`,
    the step's predicted time. The run stops there (the clock state needs the steps before)."""
    if step < 1:
        raise InputError(f"--step: must be >= 1, got {step}")
    sim = Simulation(scenario, exact=True)      # every step through execute
    executor = sim.executor
    predict = executor.execute
    found, executed = {}, [0]

    def execute(plan):
        executed[0] += 1
        if executed[0] != step:
            return predict(plan)
        cost = sim.cost_model.cost(plan)
        found.update(step=step, plan=plan_dict(plan), terms=dict(cost.terms),
                     seconds=cost.seconds, cost_model=sim.cost_model.name)
        raise _Found

    executor.execute = execute
    try:
        sim.run()
    except _Found:
        return found
    raise InputError(f"--step {step}: the simulation has {executed[0]} steps (steps.csv's "
                     "`step` column counts from 1)")


def format_explanation(found: dict) -> str:
    """The explanation as a few lines of text: the plan's counts, then each non-zero term."""
    plan = found["plan"]
    lines = [f"step {found['step']} at {plan['start_s']:.6f} s ({found['cost_model']}): "
             f"{plan['num_prefill_tokens']} prefill tokens in {plan['num_prefill_seqs']} "
             f"chunks, {plan['num_decode_seqs']} decodes over "
             f"{plan['decode_context_tokens']} context tokens, {plan['num_running']} running, "
             f"{plan['num_waiting']} waiting"]
    width = max(len(name) for name in found["terms"])
    for name, seconds in found["terms"].items():
        if seconds:
            lines.append(f"  {name:<{width}}  {seconds * 1e3:10.4f} ms")
    zero = [name for name, seconds in found["terms"].items() if not seconds]
    lines.append(f"  {'total':<{width}}  {found['seconds'] * 1e3:10.4f} ms"
                 + (f"   (zero: {', '.join(zero)})" if zero else ""))
    assert found["seconds"] == math.fsum(found["terms"].values())
    return "\n".join(lines)
