"""The SimPy simulator: the shared serving loop (simkv.engine.loop) timed by a cost model.

The loop's executor predicts each step's seconds from the cost model (`CostModelExecutor`) and
this driver lets that much simulated time pass. Arrivals and cancellations are SimPy events on
the same clock; an idle loop sleeps until the next one.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import simpy

from simkv.costmodel import load_cost_model
from simkv.engine.build import build_scheduler
from simkv.engine.loop import HORIZON, IDLE, NOW, StepGuard, serve
from simkv.engine.metrics import MetricsRecorder, add_input_notes, requests_frame, summarize
from simkv.engine.request_path import request_path
from simkv.engine.results import write_results
from simkv.sim.executor import CostModelExecutor
from simkv.sim.provenance import provenance
from simkv.workload.frames import load_requests_frame, requests_from_frame


@dataclass
class SimResult:
    summary: dict
    requests: pd.DataFrame
    steps: pd.DataFrame
    scenario: object = None
    extra: dict = field(default_factory=dict)
    provenance: dict | None = None   # where the figures come from (simkv.sim.provenance)

    def summary_json(self) -> dict:
        """summary.json's content: the summary, then its `provenance`."""
        if self.provenance is None:
            return dict(self.summary)
        return {**self.summary, "provenance": self.provenance}

    def requests_csv(self) -> pd.DataFrame:
        """requests.csv's content: the requests, with each one's `queue_s` (arrival to
        admission) last where the run kept it."""
        queue_s = self.extra.get("queue_s")
        if queue_s is None or "queue_s" in self.requests.columns:
            return self.requests
        if "replica" not in self.requests.columns:
            return self.requests.assign(queue_s=queue_s)
        # a fleet's: after the request's own columns, before where it went
        at = self.requests.columns.get_loc("replica")
        out = self.requests.copy()
        out.insert(at, "queue_s", queue_s)
        return out

    def write(self, out_dir) -> Path:
        """Write summary.json, requests.csv and steps.csv (atomically) under `out_dir`, and
        run.json beside them (when, where, the command line: simkv.sim.provenance)."""
        from simkv.sim.provenance import run_record
        return write_results(out_dir, self.summary_json(), self.requests_csv(), self.steps,
                             run=run_record(self.summary.get("wall_time_s")))

    def vllm_bench(self) -> dict:
        """The run's metrics under `vllm bench serve`'s names and units (simkv.engine.vllm_bench)."""
        from simkv.engine.vllm_bench import vllm_bench_result
        model = self.scenario.model.name if self.scenario is not None else None
        return vllm_bench_result(self.summary, self.requests, self.extra.get("itl_s"),
                                 model_id=model)


class Simulation:
    """One simulation run; `run()` returns a SimResult."""

    def __init__(self, scenario, trace_df: pd.DataFrame | None = None,
                 check_integrity: bool = False, progress: bool = False, cost_model=None,
                 step_terms: bool = False, exact: bool = False):
        """`exact`: every step planned and timed one by one (no decode runs, simkv.engine.
        decode_run); the results are the same, byte for byte."""
        self.scenario = scenario
        self.frame = trace_df if trace_df is not None else load_requests_frame(scenario)
        self.scheduler, self.sizing = build_scheduler(scenario)
        self.cost_model = cost_model or load_cost_model(scenario)
        self.recorder = MetricsRecorder(self.scheduler.kv.num_blocks,
                                        scenario.cache.block_size)
        self.check_integrity = check_integrity
        self.progress = progress
        self.decode_runs = not exact and not step_terms
        self.executor = CostModelExecutor(self.cost_model, self.scheduler.kv,
                                          self.scheduler.running, step_terms)
        self.env = simpy.Environment()
        self._wake = None
        self._arrivals_done = False
        self._served_s = None        # when the last request became final
        self._guard = None

    def _arrivals(self, requests):
        env = self.env
        scheduler = self.scheduler
        # the request path's way in (scheduler.admission_delay_s): schedulable that long after
        # its trace arrival; its cancellation timer still counts from the arrival
        admission = self.scenario.scheduler.admission_delay_s
        for req in requests:
            delay = req.arrival_s + admission - env.now
            if delay > 0:
                yield env.timeout(delay)
            scheduler.add_request(req, env.now)
            if not math.isnan(req.cancel_after_s):
                ev = env.timeout(max(0.0, req.cancel_after_s - admission))
                ev.callbacks.append(lambda _ev, rid=req.request_id: self._cancel(rid))
            if self._wake is not None and not self._wake.triggered:
                self._wake.succeed()
        self._arrivals_done = True
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _cancel(self, request_id: int) -> None:
        self.scheduler.cancel(request_id)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _drive(self, loop):
        """Run the serving loop on the SimPy clock (simkv.engine.loop's protocol)."""
        env = self.env
        check = self._guard.check
        command = next(loop)
        while True:
            if command is NOW:
                reply = env.now
            elif command is HORIZON:      # the next arrival or cancellation timer, or inf
                reply = env.peek()
            elif command is IDLE:
                if not self.scheduler.has_unfinished() and self._arrivals_done:
                    self._served_s = env.now
                    loop.close()
                    return
                self._wake = env.event()
                yield self._wake
                self._wake = None
                reply = env.now
            else:
                check(command)
                yield env.timeout(command)
                reply = env.now
            command = loop.send(reply)

    def run(self) -> SimResult:
        wall_start = time.perf_counter()
        executor = self.executor
        requests = requests_from_frame(self.frame)
        self._guard = StepGuard(requests, str(self.scenario.path or self.scenario.name))
        horizon = requests[-1].arrival_s if requests else 0.0
        self.env.process(self._arrivals(requests))
        progress_ctx = _progress_bar(self.progress, horizon, self.scenario.name)
        with progress_ctx as on_progress:
            loop = serve(self.scheduler, executor, self.recorder,
                         check_integrity=self.check_integrity, on_step=_every(4096, on_progress),
                         decode_runs=self.decode_runs,
                         async_scheduling=self.scenario.scheduler.async_scheduling)
            self.env.process(self._drive(loop))
            self.env.run()
        # The run ends when the last request is final, as the engine's does: a cancellation
        # timer of a request already finished fires later and changes nothing.
        sim_duration = self._served_s if self._served_s is not None else self.env.now
        req_df = requests_frame(self.scheduler.done)
        steps_df = self.recorder.steps_frame()
        sched_cfg = self.scenario.scheduler
        if sched_cfg.output_delay_s or sched_cfg.output_delay_per_running_s:
            req_df = client_times(req_df, steps_df, sched_cfg.output_delay_s,
                                  sched_cfg.output_delay_per_running_s)
        if executor.terms:     # --step-terms: a column per cost term, in seconds
            terms = pd.DataFrame(executor.terms).add_prefix("term_")
            steps_df = pd.concat([steps_df, terms.set_index(steps_df.index)], axis=1)
        summary = summarize(self.recorder, self.scheduler, req_df,
                            sim_duration_s=sim_duration,
                            wall_time_s=time.perf_counter() - wall_start,
                            slo=self.scenario.slo, cost_model=self.cost_model.name,
                            block_size=self.scenario.cache.block_size)
        summary["wall_time_s"] = time.perf_counter() - wall_start
        path = request_path(sched_cfg)
        if path:
            summary["request_path"] = path
        add_input_notes(summary, self.frame)
        extra = {"sizing": self.sizing.to_dict() if hasattr(self.sizing, "to_dict") else {},
                 "itl_s": np.frombuffer(self.scheduler.itl_s, dtype=np.float64)
                 if len(self.scheduler.itl_s) else np.zeros(0),
                 "queue_s": req_df["queue_s"].to_numpy(),
                 "rejected_reasons": {r.request_id: r.reason for r in self.scheduler.done
                                      if r.reason}}
        if getattr(self.cost_model, "is_estimate", False):
            summary["cost_model_note"] = getattr(self.cost_model, "note", "estimate from specs")
        return SimResult(summary, req_df.drop(columns=["queue_s"]), steps_df, self.scenario,
                         extra, provenance(self.scenario, self.cost_model))


def client_times(req_df: pd.DataFrame, steps_df: pd.DataFrame, delay_s: float,
                 per_running_s: float) -> pd.DataFrame:
    """The requests as the client sees them: each output reaches it `delay_s` +
    `per_running_s` x (requests running in the step that made it) after that step's end, so a
    request's first token and its finish move by the delays of their own steps (TTFT, E2E and
    TPOT follow). The steps and the inter-token gaps stay on the engine's clock."""
    out = req_df.copy()
    ends = (steps_df["start_s"] + steps_df["duration_s"]).to_numpy(dtype=np.float64)
    running = steps_df["num_running"].to_numpy(dtype=np.float64)

    def delay(times: np.ndarray) -> np.ndarray:
        d = np.full(len(times), float(delay_s))
        if per_running_s and len(ends):
            # the step whose end is the time (the output's step), to rounding
            k = np.clip(np.searchsorted(ends, times - 1e-9), 0, len(ends) - 1)
            hit = np.isfinite(times) & (np.abs(ends[k] - times) <= 1e-9 * np.maximum(1.0, times))
            d[hit] += per_running_s * running[k[hit]]
        return d

    done = (out["status"] == "completed").to_numpy()
    first = out["first_token_s"].to_numpy(dtype=np.float64)
    finish = out["finish_s"].to_numpy(dtype=np.float64)
    d_first, d_finish = delay(first), delay(finish)
    first_new = np.where(np.isfinite(first), first + d_first, first)
    finish_new = np.where(done, finish + d_finish, finish)
    arrival = out["arrival_s"].to_numpy(dtype=np.float64)
    n = out["output_tokens"].to_numpy(dtype=np.float64)
    out["first_token_s"] = first_new
    out["finish_s"] = finish_new
    out["ttft_s"] = np.where(done, first_new - arrival, out["ttft_s"])
    out["e2e_s"] = np.where(done, finish_new - arrival, out["e2e_s"])
    # TPOT moves by the difference of the two delays over the gaps (a fanned-out request's,
    # its children's mean, by its first and last sample's)
    tpot = out["tpot_s"].to_numpy(dtype=np.float64)
    out["tpot_s"] = np.where(done & (n > 1), tpot + (d_finish - d_first) / np.maximum(n - 1, 1),
                             tpot)
    return out


class _NoProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class _RichProgress:
    def __init__(self, horizon_s: float, label: str):
        from rich.progress import (BarColumn, Progress, TextColumn, TimeElapsedColumn)
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                 TextColumn("{task.completed:.0f}/{task.total:.0f} sim s"),
                                 TimeElapsedColumn(), transient=True)
        self.horizon = max(horizon_s, 1e-9)
        self.label = label

    def __enter__(self):
        self.progress.__enter__()
        task = self.progress.add_task(self.label, total=self.horizon)
        return lambda now: self.progress.update(task, completed=min(now, self.horizon))

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)


def _every(steps: int, on_progress):
    """An on_step callback that reports the clock every `steps` steps (None without progress)."""
    if on_progress is None:
        return None
    count = [0]

    def on_step(plan, end_s: float) -> None:
        count[0] += 1
        if count[0] % steps == 0:
            on_progress(end_s)
    return on_step


def _progress_bar(enabled: bool, horizon_s: float, label: str):
    return _RichProgress(horizon_s, label) if enabled else _NoProgress()


def simulate(scenario, *, trace_df: pd.DataFrame | None = None, check_integrity: bool = False,
             progress: bool = False, cost_model=None, step_terms: bool = False,
             exact: bool = False) -> SimResult:
    """Simulate a scenario; returns summary (dict), requests and steps (DataFrames).

    `trace_df` replaces the scenario's workload; `cost_model` (anything with `predict(plan) ->
    seconds` and a `name`; with `reset()` if it keeps state across steps, called as the run
    starts) replaces the scenario's; `check_integrity` runs the KV manager's integrity check
    after every step (slow on big pools); `step_terms` adds a `term_<name>` column per cost term
    to the steps frame (seconds; they sum to duration_s but for the last bit); `exact` plans and
    times every step one by one (the same results; without it, steps that only decode the same
    batch are taken together: simkv.engine.decode_run). A scenario with a `cluster:` section
    runs as a fleet (simkv.sim.cluster.fleet)."""
    if getattr(scenario, "cluster", None) is not None:
        from simkv.sim.cluster.fleet import simulate_fleet
        result = simulate_fleet(scenario, trace_df=trace_df, check_integrity=check_integrity,
                                cost_model=cost_model, step_terms=step_terms, exact=exact)
        if result.provenance is None:
            models = [cost_model] if cost_model is not None else \
                [load_cost_model(pool.scenario) for pool in scenario.cluster.pools]
            result.provenance = provenance(scenario, models)
        return result
    return Simulation(scenario, trace_df, check_integrity, progress, cost_model,
                      step_terms, exact).run()
