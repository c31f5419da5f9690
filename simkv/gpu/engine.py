"""The real engine: the shared scheduler and KV manager driving the GPU executor.

    while work remains:
        plan = scheduler.schedule(now)
        seconds, outputs = executor.execute(plan)     # the step, for real
        scheduler.finish_step(plan, outputs, now)

It is the simulator's serving loop (`simkv.engine.loop`, the same generator) with the cost
model's executor replaced by the GPU's and the SimPy clock by the wall clock: requests arrive
when the wall clock passes their arrival time (`realtime=True`) or all at 0 (`realtime=False`,
offline), cancellations fire `cancel_after_s` after arrival, and the same MetricsRecorder writes the same summary.json / requests.csv /
steps.csv, measured. Extra outputs: `ledger.json` (device memory, `simkv.gpu.ledger`), and with
`save_tokens` `tokens.jsonl` (request_id, sample, token_ids: the generated tokens).

steps.csv gains two columns: `gpu_s` (device time of the step: the CUDA-event span from its first
memory operation to the sampled tokens on the host, less the host input preparation inside that
span) and `host_s` = duration_s − gpu_s (the time the device waits for the host: scheduling,
input preparation, bookkeeping; in eager steps launch gaps count as device time).

Prompt token ids come from the trace's prefix identities (`simkv.gpu.tokens`). simpy is never
imported here (the device machine has none).
"""
from __future__ import annotations

import datetime
import heapq
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.engine.metrics import MetricsRecorder, add_input_notes, requests_frame, summarize
from simkv.engine.request import Request
from simkv.errors import InputError
from simkv.engine.results import atomic_write_text, write_results
from simkv.gpu.host import frozen_heap
from simkv.engine.build import build_scheduler
from simkv.engine.loop import IDLE, NOW, serve
from simkv.workload.frames import load_requests_frame, requests_from_frame


@dataclass
class ReplayResult:
    """A real-engine run: the simulator's result frames (measured) plus the memory ledger."""

    summary: dict
    requests: pd.DataFrame
    steps: pd.DataFrame
    ledger: dict
    tokens: dict                       # (request_id, sample) -> generated token ids
    scenario: object = None
    extra: dict = field(default_factory=dict)

    def write(self, out_dir, save_tokens: bool = False) -> Path:
        """summary.json, requests.csv, steps.csv, ledger.json (and tokens.jsonl) under out_dir."""
        out = write_results(out_dir, self.summary, self.requests, self.steps)
        atomic_write_text(out / "ledger.json", json.dumps(self.ledger, indent=2, default=_json) + "\n")
        if save_tokens:
            lines = [json.dumps({"request_id": rid, "sample": sample, "token_ids": ids})
                     for (rid, sample), ids in sorted(self.tokens.items())]
            atomic_write_text(out / "tokens.jsonl", "\n".join(lines) + ("\n" if lines else ""))
        return out


@dataclass
class OfflineRun:
    """`run_offline`'s answer: what the identity tests compare."""

    step_tokens: list                  # (num_prefill_tokens, num_decode_tokens) per step
    tokens: dict                       # (request_id, sample) -> generated token ids
    result: ReplayResult
    scheduler: object

    @property
    def preemptions(self) -> int:
        return self.scheduler.num_preemptions


def _fresh(req: Request) -> Request:
    """An unscheduled copy of a request (the scheduler mutates the ones it is given)."""
    return Request(req.request_id, req.arrival_s, req.prompt_tokens, req.output_tokens, n=req.n,
                   prefix_ids=req.prefix_ids, prefix_block_tokens=req.prefix_block_tokens,
                   tenant=req.tenant, adapter=req.adapter, mm_key=req.mm_key,
                   cancel_after_s=req.cancel_after_s, priority=req.priority,
                   prompt_token_ids=None if req.prompt_token_ids is None
                   else list(req.prompt_token_ids), mm_spans=req.mm_spans,
                   parent_request_id=req.parent_request_id)


def engine_kv_groups(sizing):
    """The executor's `kv_groups` for a scenario's sizing: its KV cache groups where the KV
    manager keeps a table per group (a window or linear group beside full ones), else None: one
    table for every layer."""
    groups = getattr(sizing, "kv_groups", None) or []
    return groups if any(g["attention_type"] != "full" for g in groups) else None


class _MeasuredExecutor:
    """The GPU executor as the serving loop's: runs each step and keeps its device times."""

    def __init__(self, engine: "Engine"):
        self.engine, self.ex, self.kv = engine, engine.executor, engine.scheduler.kv

    def execute(self, plan) -> tuple:
        ex, engine = self.ex, self.engine
        outputs = ex.execute(plan, self.kv)
        engine.gpu_s.append(ex.last_gpu_s - ex.last_prep_s)
        engine.exec_s.append(ex.last_gpu_s)
        engine.num_seqs.append(len(plan.scheduled))
        return ex.last_gpu_s, outputs

    def step_done(self, plan) -> None:
        if self.ex.poison:
            self.ex.poison_free_blocks(self.kv)


class Engine:
    """One scenario on one device: scheduler + KV manager (shared core) + GpuExecutor."""

    def __init__(self, scenario, device: str | None = None, *, dtype=None,
                 attention: str | None = None, enforce_eager: bool = False,
                 poison: bool | None = None, check_integrity: bool = False, executor=None):
        if scenario.scheduler.async_scheduling:
            raise InputError("scheduler.async_scheduling: the real engine schedules "
                             "synchronously; set it to false to run on the GPU")
        from simkv.engine.request_path import refuse_request_path
        refuse_request_path(scenario, "the real engine")
        from simkv.gpu.executor import GpuExecutor
        if getattr(scenario, "tensor_parallel_size", 1) > 1 \
                and not getattr(self, "tensor_parallel_rank", False):
            raise InputError(f"tensor_parallel_size {scenario.tensor_parallel_size}: the engine "
                             "runs one process per rank (simkv.gpu.tensor_parallel; simkv "
                             "replay starts them)")
        self.scenario = scenario
        self.scheduler, self.sizing = build_scheduler(scenario)
        kv = self.scheduler.kv
        block_size = scenario.cache.block_size
        if executor is None:
            executor = GpuExecutor(
                scenario.model, kv.num_blocks, block_size, self.sizing.num_host_blocks,
                device=device, dtype=dtype, attention=attention, enforce_eager=enforce_eager,
                seed=scenario.seed, max_num_seqs=scenario.scheduler.max_num_seqs,
                max_model_len=self.scheduler.max_model_len,
                max_num_batched_tokens=scenario.scheduler.max_num_batched_tokens, poison=poison,
                kv_groups=self._kv_groups())
        elif executor.num_blocks < kv.num_blocks or executor.block_size != block_size:
            raise ValueError("the executor's cache does not match the scenario's pool")
        elif executor.kv_groups != self._kv_groups():
            raise ValueError("the executor's KV cache groups are not the scenario's")
        if poison is not None:
            executor.poison = poison
        if scenario.cache.preemption_mode == "swap":
            executor.reserve_swap_space()
        self.executor = executor
        self.recorder = MetricsRecorder(kv.num_blocks, block_size)
        self.check_integrity = check_integrity
        self.gpu_s: list = []       # per step: device span of execute() without input building
        self.exec_s: list = []      # per step: the span of execute() (what the profiler times)
        self.num_seqs: list = []    # per step: sequences scheduled

    def _kv_groups(self):
        return engine_kv_groups(self.sizing)

    def run(self, requests: list, realtime: bool = True, progress=None) -> float:
        """Serve `requests` (fresh Request objects, arrival order) until all are final; returns
        the run's duration in seconds. Offline (`realtime=False`): every arrival is at 0."""
        from simkv.gpu.tokens import assign_prompt_tokens
        for req in requests:
            if req.parent_request_id >= 0:
                raise InputError(f"request {req.request_id} continues request "
                                 f"{req.parent_request_id} (parent_request_id): turns are "
                                 "simulated only (the engine has no tokens for an answer not "
                                 "yet generated)")
        assign_prompt_tokens(requests, self.scenario.model.vocab_size, self.scenario.seed)
        if not realtime:
            for req in requests:
                req.arrival_s = 0.0
        requests = sorted(requests, key=lambda r: r.arrival_s)
        with frozen_heap():     # what is alive now stays out of the collections in the run
            return self._serve(requests, progress)

    def _serve(self, requests: list, progress) -> float:
        """Run the serving loop (simkv.engine.loop) by the wall clock; returns the duration."""
        sched = self.scheduler
        loop = serve(sched, _MeasuredExecutor(self), self.recorder,
                     check_integrity=self.check_integrity, on_step=progress)
        cancels: list = []
        pending = iter(requests)
        upcoming = next(pending, None)
        clock0 = time.perf_counter()

        def admit(now: float) -> None:
            """Requests that have arrived and cancellations that are due, by `now`."""
            nonlocal upcoming
            while upcoming is not None and upcoming.arrival_s <= now:
                sched.add_request(upcoming, now)
                if not math.isnan(upcoming.cancel_after_s):
                    heapq.heappush(cancels, (upcoming.arrival_s + upcoming.cancel_after_s,
                                             upcoming.request_id))
                upcoming = next(pending, None)
            while cancels and cancels[0][0] <= now:
                sched.cancel(heapq.heappop(cancels)[1])

        command = next(loop)
        while True:
            now = self._now(clock0)
            if command is IDLE:
                if upcoming is None and not sched.requests:
                    loop.close()
                    break
                wake = min(upcoming.arrival_s if upcoming is not None else math.inf,
                           cancels[0][0] if cancels else math.inf)
                time.sleep(max(0.0, min(wake - now, 0.05)))
                now = self._now(clock0)
            if command is IDLE or command is NOW:
                admit(now)
            command = loop.send(now)    # after a step: the time its tokens exist
        return time.perf_counter() - clock0

    def _now(self, clock0: float) -> float:
        """Seconds since the run started (a tensor-parallel rank takes rank 0's)."""
        return time.perf_counter() - clock0

    def result(self, duration_s: float, wall_time_s: float) -> ReplayResult:
        sched, ex, scn = self.scheduler, self.executor, self.scenario
        req_df = requests_frame(sched.done)
        steps = self.recorder.steps_frame()
        steps["gpu_s"] = np.asarray(self.gpu_s, dtype=np.float64)
        steps["host_s"] = steps["duration_s"] - steps["gpu_s"]
        steps["exec_s"] = np.asarray(self.exec_s, dtype=np.float64)
        steps["num_seqs"] = np.asarray(self.num_seqs, dtype=np.int64)
        summary = summarize(self.recorder, sched, req_df, sim_duration_s=duration_s,
                            wall_time_s=wall_time_s, slo=scn.slo, cost_model="measured",
                            block_size=scn.cache.block_size)
        summary["device"] = _device_name(ex.device)
        summary["step_gpu_s_mean"] = _mean(steps["gpu_s"])
        summary["step_host_s_mean"] = _mean(steps["host_s"])
        tokens = {}
        for req in sched.done:
            for seq in req.all_seqs:
                if seq.token_ids is not None:
                    tokens[(req.request_id, seq.sample)] = list(seq.token_ids[req.prompt_tokens:])
        kv = sched.kv
        bytes_per_block = ex.kv_pool_bytes // max(1, ex.num_blocks)
        extra = {
            "engine": engine_info(ex),
            "sizing": self.sizing.to_dict(),
            "kv_blocks_used_peak": int(self.recorder.used_peak),
            "kv_used_peak_bytes": int(self.recorder.used_peak * bytes_per_block),
            "kv_reserved_unused_at_peak_bytes": int((kv.num_blocks - self.recorder.used_peak)
                                                    * bytes_per_block),
            "profile": ex.profile,
        }
        if ex.ledger is not None:
            ledger = ex.ledger.report(ex.weight_bytes, ex.kv_pool_bytes,
                                      ex.profile.get("peak_bytes", 0), extra)
        else:
            from simkv.gpu.ledger import cpu_ledger
            ledger = cpu_ledger(ex.weight_bytes, ex.kv_pool_bytes, extra)
        return ReplayResult(summary, req_df.drop(columns=["queue_s"]), steps, ledger, tokens,
                            scn, {"rejected_reasons": {r.request_id: r.reason for r in sched.done
                                                       if r.reason}})


def replay(scenario, device: str = "cuda", out_dir=None, save_tokens: bool = False,
           realtime: bool = True, *, trace_df: pd.DataFrame | None = None, dtype=None,
           attention: str | None = None, enforce_eager: bool = False,
           poison: bool | None = None, check_integrity: bool = False,
           progress: bool = False) -> ReplayResult:
    """Run a scenario on the real engine (`simkv replay SCENARIO --device cuda|cpu`).

    `scenario`: a Scenario (`simkv.load_scenario`) or a path to its YAML. Requests come from the
    scenario's workload (or `trace_df`, a canonical trace frame) and arrive by the wall clock
    (`realtime`) or all at 0. `device` 'cuda' runs bf16 with the Triton kernels and CUDA graphs
    (`enforce_eager` off), 'cpu' float64 with the torch reference attention (tiny models);
    `dtype`/`attention` override. `poison` (default: $SIMKV_POISON_FREED) turns on the NaN
    poisoning debug mode. Times in seconds of the wall clock from the start of the run.

    Returns a ReplayResult (.summary dict as summary.json, .requests and .steps DataFrames,
    .ledger dict, .tokens); with `out_dir` writes summary.json, requests.csv, steps.csv,
    ledger.json and, with `save_tokens`, tokens.jsonl there.
    """
    if isinstance(scenario, (str, Path)):
        from simkv.config.scenario import load_scenario
        scenario = load_scenario(scenario)
    wall0 = time.perf_counter()
    frame = trace_df if trace_df is not None else load_requests_frame(scenario)
    engine = Engine(scenario, device, dtype=dtype, attention=attention,
                    enforce_eager=enforce_eager, poison=poison, check_integrity=check_integrity)
    on_step = _progress_printer(len(frame)) if progress else None
    duration = engine.run(requests_from_frame(frame), realtime=realtime, progress=on_step)
    result = engine.result(duration, time.perf_counter() - wall0)
    add_input_notes(result.summary, frame)        # requests_dropped and warnings, as the simulator
    if out_dir is not None:
        result.write(out_dir, save_tokens=save_tokens)
    return result


def run_offline(scenario, requests, *, device: str | None = "cpu", dtype=None,
                attention: str | None = None, enforce_eager: bool = False,
                poison: bool | None = None, check_integrity: bool = True,
                executor=None) -> OfflineRun:
    """Serve `requests` (Request objects or a canonical trace frame) with every arrival at t=0.

    Returns the scheduler's per-step (num_prefill_tokens, num_decode_tokens) sequence and the
    generated tokens per (request_id, sample); the requests given are not modified. KV integrity
    is checked after every step unless `check_integrity` is off. `executor` reuses a GpuExecutor
    whose cache is at least the scenario's pool.
    """
    if isinstance(requests, pd.DataFrame):
        requests = requests_from_frame(requests)
    requests = [_fresh(r) for r in requests]
    engine = Engine(scenario, device, dtype=dtype, attention=attention,
                    enforce_eager=enforce_eager, poison=poison, check_integrity=check_integrity,
                    executor=executor)
    wall0 = time.perf_counter()
    duration = engine.run(requests, realtime=False)
    result = engine.result(duration, time.perf_counter() - wall0)
    steps = list(zip(result.steps["num_prefill_tokens"].tolist(),
                     result.steps["num_decode_tokens"].tolist()))
    return OfflineRun(steps, result.tokens, result, engine.scheduler)


# ----------------------------------------------------------------------------------------------


def engine_info(executor) -> dict:
    """Device, software versions and executor settings, for result files."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover
        triton_version = None
    return {
        "device": _device_name(executor.device),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "dtype": str(executor.dtype).replace("torch.", ""),
        "attention": executor.attention,
        "cuda_graphs": bool(executor.use_graphs),
        "graph_steps": int(executor.num_graph_steps),
        "mixed_graph_steps": int(getattr(executor, "num_mixed_graph_steps", 0)),
        "eager_steps": int(executor.num_eager_steps),
        "poison": bool(executor.poison),
        "model": executor.spec.name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }


def _device_name(device) -> str:
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def _mean(series) -> float | None:
    values = np.asarray(series, dtype=np.float64)
    values = values[~np.isnan(values)]
    return float(values.mean()) if len(values) else None


def _json(value):
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _progress_printer(total: int):
    state = {"last": 0.0}

    def on_step(plan, now_s: float) -> None:
        if now_s - state["last"] >= 5.0:
            state["last"] = now_s
            print(f"[replay] t={now_s:7.1f}s step {plan.step} running {plan.num_running} "
                  f"waiting {plan.num_waiting} of {total} requests", file=sys.stderr, flush=True)
    return on_step
