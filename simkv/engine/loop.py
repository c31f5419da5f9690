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
  time then, or sends None when no more will come (the loop ends);
- `HORIZON` (only with `decode_runs`): the driver sends the time of the next arrival or
  cancellation it knows of (inf: none) and lets no time pass;
- a `RunSteps` (only with `cut_runs`): a decode run's step ends; the driver lets time pass to
  the last of them, or to an earlier one where something reached the replica inside the run,
  and sends the end it stopped at; the loop then keeps the run's steps up to there.

With `decode_runs` and an executor that times decode runs (`run_seconds`, the simulator's), a
plan that only decodes the batch starts a decode run (simkv.engine.decode_run): it and the
steps after it up to the horizon, timed and applied together, the driver's clock moved by
`seconds` to where it would have added up to step by step (one delay, or two where the sum's
rounding steps over the end).

The driver owns arrivals and cancellations (it calls `scheduler.add_request` / `cancel` at their
times), so N replicas are N loops on one clock, each with its own scheduler, executor and
recorder.

With `async_scheduling`, the loop does what vLLM v0.26's engine does with two batches in flight
(vllm/v1/engine/core.py, EngineCore.step_with_batch_queue): right after a step is launched it
schedules the next one, from the state before the step's outputs, with the step's tokens
counted as computed (the scheduler's `launch_step`); the step's outputs are applied when it
ends (`finish_launched_step`) and the plan made at its start runs next, or, where that plan
was empty, one made then. Every step is taken one by one (no decode runs).
"""
from __future__ import annotations

import math
from itertools import accumulate
from typing import Protocol

from simkv.engine.decode_run import RunAttempts, decode_run
from simkv.errors import InputError

NOW = "now"
IDLE = "idle"
HORIZON = "horizon"
REPLANS = 3        # plans in a row that only preempt or cancel before the loop gives up


class Executor(Protocol):
    def execute(self, plan) -> tuple:
        """Carry out the plan: (seconds the step takes, outputs for `finish_step`)."""

    def step_done(self, plan) -> None:
        """The scheduler has finished the step (the GPU poisons freed blocks in debug runs)."""


class RunSteps:
    """A decode run for the driver to let pass (module doc): `run` (simkv.engine.decode_run)
    and `ends` (its start, then each step's end, as the clock adds them up)."""

    __slots__ = ("run", "ends")

    def __init__(self, run, ends: list):
        self.run, self.ends = run, ends


def serve(scheduler, executor, recorder, *, check_integrity: bool = False, on_step=None,
          decode_runs: bool = False, async_scheduling: bool = False, cut_runs: bool = False):
    """Serve until the driver says nothing more will arrive (module doc for the protocol).

    `recorder` observes each plan before it runs and records it after (start, duration);
    `check_integrity` runs the KV manager's integrity check after every step (after every
    decode run); `on_step(plan, end_s)` is called after each step (each decode run);
    `decode_runs` takes decode runs together where the executor can time them;
    `async_scheduling` schedules each step as the one before it starts (module doc), without
    decode runs; `cut_runs` hands each decode run to the driver as a `RunSteps`, which may
    stop it at an earlier step's end (a fleet's arrival routed to the replica inside it)."""
    kv = scheduler.kv
    runs = getattr(executor, "run_seconds", None) if decode_runs and not async_scheduling \
        else None
    attempts = RunAttempts()
    observe, record = recorder.observe, recorder.record_step
    execute, step_done = executor.execute, executor.step_done
    now = yield NOW
    empty_in_a_row = 0
    upcoming = None        # async: the plan made as the last step started
    while True:
        if upcoming is not None and not upcoming.is_empty:
            plan = upcoming
        else:
            plan = scheduler.schedule(now)
        upcoming = None
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
        run = decode_run(scheduler, plan, attempts) if runs is not None else None
        if run is not None:
            seconds = runs(run, now, (yield HORIZON))
            attempts.found(len(seconds))
            ends = list(accumulate(seconds, initial=now))   # as the driver's clock adds them
            if cut_runs:
                end = yield RunSteps(run, ends)
                if end != ends[-1]:         # stopped at step k's end: keep steps 1..k
                    k = ends.index(end)
                    executor.cut_run(run, now, ends[:k + 1])
                    ends = ends[:k + 1]
            else:
                for delay in hops(ends):
                    end = yield delay
            if end != ends[-1]:
                raise RuntimeError(f"decode run: the clock reads {end!r}, not {ends[-1]!r}")
            run.commit(ends, recorder)      # at the end, as each step finishes at its end
            step_done(plan)
            if check_integrity:
                kv.check_integrity()
            if on_step is not None:
                on_step(plan, end)
            now = end
            continue
        observe(plan, scheduler)
        seconds, outputs = execute(plan)
        if async_scheduling:
            scheduler.launch_step(plan)
            upcoming = scheduler.schedule(now)     # arrivals up to the step's start
            token_s = yield seconds
            scheduler.finish_launched_step(plan, outputs, token_s)
        else:
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


class StepGuard:
    """A bound on the delays a driver lets pass, derived from the workload and not from the
    wall clock: each must be a finite number of seconds >= 0, and a run takes at most
    `max_delays` of them (each is a step, or a hop of a decode run), STEPS_PER_TOKEN per
    token of work the requests ask for (prompt + output, times n) plus STEPS_PER_REQUEST per
    request. A step computes at least one token, so only recomputation after preemptions
    takes a valid run past one step per token; a run past the bound makes no progress
    (tests/test_bad_input.py::test_a_loop_that_makes_no_progress_stops_with_one_error)."""

    STEPS_PER_TOKEN = 64
    STEPS_PER_REQUEST = 64
    BASE = 10_000

    def __init__(self, requests, source: str):
        work = sum(r.n * (r.prompt_tokens + r.output_tokens) for r in requests)
        self.max_delays = self.STEPS_PER_TOKEN * work + self.STEPS_PER_REQUEST * len(requests) \
            + self.BASE
        self.delays = 0
        self.source = source

    def check(self, seconds) -> None:
        """Raise InputError for a delay that is not finite and >= 0, or one past the bound."""
        self.delays += 1
        if not 0.0 <= seconds < math.inf:
            raise InputError(f"{self.source}: step {self.delays}: the cost model predicts "
                             f"{seconds!r} s; a step takes a finite number of seconds >= 0 "
                             "(check the cost model and cost_model.step_time_scale)")
        if self.delays > self.max_delays:
            raise InputError(f"{self.source}: the run passed {self.max_delays:,} steps, the "
                             "bound for this workload (64 per token of work and per "
                             "request): the scheduler is making no progress")


def hops(ends: list) -> list:
    """Delays that take a clock at ends[0] to ends[-1] exactly, through points of `ends`, when
    each is added to the clock in floating point: mostly one, ends[-1] - ends[0] give or take
    an ulp; where no delay lands there (the sum's rounding can step over a value), a hop to
    an earlier point first (from ends[j - 1], the step's own seconds reach ends[j])."""
    out, i, last = [], 0, len(ends) - 1
    while i < last:
        for j in range(last, i, -1):
            delay = delay_to(ends[i], ends[j])
            if delay is not None:
                out.append(delay)
                i = j
                break
        else:
            raise RuntimeError(f"decode run: no delay from {ends[i]!r} to {ends[i + 1]!r}")
    return out


def delay_to(now: float, target: float) -> float | None:
    """A delay d >= 0 with `now + d == target` in floating point, or None."""
    d = target - now
    if d >= 0 and now + d == target:        # mostly: the difference itself
        return d
    for candidate in (math.nextafter(d, math.inf), math.nextafter(d, -math.inf)):
        if candidate >= 0 and now + candidate == target:
            return candidate
    return None
