"""The serving loop of one replica, written once for every clock.

`serve` is a generator that a driver runs: the SimPy simulator (simkv.sim.engine, whose
executor predicts each step's seconds from a cost model) and the real engine (simkv.gpu.engine,
whose executor runs the step on the GPU and whose clock is the wall clock). The loop yields what
it needs from the clock and the driver sends back the time:

- `seconds` (a float): a step was executed that takes this long; the driver lets that much time
  pass (the simulator) or has already spent it (the GPU) and sends the time the step's tokens
  exist;
- `NOW`: the driver sends the current time and lets no time pass;
- `IDLE`: nothing can run; the driver waits for the next arrival or cancellation and sends the
  time then, or sends None when no more will come (the loop ends).

The driver owns arrivals and cancellations (it calls `scheduler.add_request` / `cancel` at their
times), so N replicas are N loops on one clock, each with its own scheduler, executor and
recorder.
"""
from __future__ import annotations

from typing import Protocol

NOW = "now"
IDLE = "idle"
REPLANS = 3        # plans in a row that only preempt or cancel before the loop gives up


class Executor(Protocol):
    def execute(self, plan) -> tuple:
        """Carry out the plan: (seconds the step takes, outputs for `finish_step`)."""

    def step_done(self, plan) -> None:
        """The scheduler has finished the step (the GPU poisons freed blocks in debug runs)."""


def serve(scheduler, executor, recorder, *, check_integrity: bool = False, on_step=None):
    """Serve until the driver says nothing more will arrive (module doc for the protocol).

    `recorder` observes each plan before it runs and records it after (start, duration);
    `check_integrity` runs the KV manager's integrity check after every step; `on_step(plan,
    end_s)` is called after each step."""
    kv = scheduler.kv
    observe, record = recorder.observe, recorder.record_step
    execute, step_done = executor.execute, executor.step_done
    now = yield NOW
    empty_in_a_row = 0
    while True:
        plan = scheduler.schedule(now)
        if plan.is_empty:
            if scheduler.waiting or scheduler.running or scheduler.swapped:
                empty_in_a_row += 1
                if (plan.preempted or plan.cancelled) and empty_in_a_row < REPLANS:
                    continue          # a step that only preempted or cancelled: plan again
                raise RuntimeError(f"step {plan.step}: requests wait but nothing can run")
            now = yield IDLE
            if now is None:
                return
            continue
        empty_in_a_row = 0
        observe(plan, scheduler)
        seconds, outputs = execute(plan)
        token_s = yield seconds
        scheduler.finish_step(plan, outputs, token_s)
        step_done(plan)
        if check_integrity:
            kv.check_integrity()
        end = yield NOW
        record(plan, now, end - now)
        if on_step is not None:
            on_step(plan, end)
        now = end
