"""GPU side of the validation (simpy-free): the real engine serves a scenario's requests, all
at t=0 (saturated throughput), then by the wall clock; both runs measured into a folder.

steps.csv gains `span_s` (the executor's CUDA-event span of `execute(plan)`, what the profile
measured) and `prep_s` (host input preparation inside it); `duration_s - span_s` is the engine's
host time outside the profile. Nothing here may import simpy: the GPU machine has none.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from simkv.gpu.host import host_conditions, pin_to_cpu
from simkv.validation.data import (RUNS, load_validation_scenario, requests_fingerprint,
                                   write_json)

LONG_STEP_S = 0.25          # a step this long on the GPU is a compile stall or a hiccup


class _Bench:
    """One executor kept across runs (same model, pool and block size), and saturated runs
    kept for scenarios that differ only in arrival times (time_scale)."""

    def __init__(self, device: str, warmup_requests: int = 16, progress: bool = False):
        self.device = device
        self.warmup_requests = warmup_requests
        self.progress = progress
        self.executor = None
        self.executor_key = None
        self.setup = {}
        self.saturated = {}

    @staticmethod
    def _executor_key(scn, num_blocks: int) -> tuple:
        s = scn.scheduler
        return (scn.model.name, scn.cache.block_size, num_blocks, scn.cache.kv_dtype, scn.seed,
                s.max_num_seqs, s.max_model_len, s.max_num_batched_tokens)

    def engine(self, scn, frame):
        from simkv.sizing import size_scenario
        sizing = size_scenario(scn)
        key = self._executor_key(scn, sizing.num_blocks)
        if key != self.executor_key:
            self.release()
            t0 = time.perf_counter()
            engine = self.new_engine(scn)
            self.executor, self.executor_key = engine.executor, key
            self.setup = {"executor_build_s": time.perf_counter() - t0}
            if self.warmup_requests:   # every kernel variant compiled before a timed run
                t0 = time.perf_counter()
                warm = frame.iloc[:self.warmup_requests].copy()
                warm["output_tokens"] = warm["output_tokens"].clip(upper=4)
                self._run(scn, warm, realtime=False)
                self.setup["warmup_s"] = time.perf_counter() - t0
                self.setup["warmup_requests"] = len(warm)
            return engine
        return self.new_engine(scn, self.executor)

    def new_engine(self, scn, executor=None):
        """An Engine of `scn` (on `executor` when given; a tensor-parallel rank's differs)."""
        from simkv.gpu.engine import Engine
        return Engine(scn, self.device, executor=executor)

    def release(self) -> None:
        if self.executor is None:
            return
        import gc

        from simkv.gpu.device import release_cuda_cache
        self.executor = self.executor_key = None
        self.saturated.clear()
        gc.collect()
        release_cuda_cache()

    def _run(self, scn, frame, realtime: bool, engine=None):
        """(ReplayResult, steps with span_s/prep_s) of one run."""
        from simkv.gpu.engine import _progress_printer, engine_info, requests_from_frame
        engine = engine or self.engine(scn, frame)
        ex = engine.executor
        spans = []
        printer = _progress_printer(len(frame)) if self.progress else None

        def on_step(plan, now_s):
            spans.append((ex.last_gpu_s, ex.last_prep_s))
            if printer:
                printer(plan, now_s)
        wall0 = time.perf_counter()
        graph0, eager0 = ex.num_graph_steps, ex.num_eager_steps
        duration = engine.run(requests_from_frame(frame), realtime=realtime, progress=on_step)
        result = engine.result(duration, time.perf_counter() - wall0)
        info = engine_info(ex)
        info["graph_steps"] = ex.num_graph_steps - graph0     # this run's, not the executor's
        info["eager_steps"] = ex.num_eager_steps - eager0
        result.extra.update(engine=info, sizing=engine.sizing.to_dict())
        span = np.array(spans, dtype=np.float64).reshape(-1, 2)
        result.steps["span_s"] = span[:, 0]
        result.steps["prep_s"] = span[:, 1]
        return result

    def measure(self, scn, frame) -> dict:
        """{'saturated': ReplayResult, 'realtime': ReplayResult, 'setup': {...}}."""
        raw = json.loads(json.dumps(scn.raw, default=str))
        raw.pop("name", None)
        (raw.get("workload") or {}).pop("time_scale", None)
        sat_key = (json.dumps(raw, sort_keys=True), requests_fingerprint(frame, arrivals=False))
        engine = self.engine(scn, frame)
        setup = dict(self.setup)
        if sat_key in self.saturated:
            saturated = self.saturated[sat_key]
            setup["saturated_shared"] = True
        else:
            saturated = self._run(scn, frame, realtime=False, engine=engine)
            self.saturated[sat_key] = saturated
            engine = self.engine(scn, frame)
        realtime = self._run(scn, frame, realtime=True, engine=engine)
        return {"saturated": saturated, "realtime": realtime, "setup": setup}


def measure_validation(scenario, out_dir, device: str = "cuda", *, trace_df=None,
                       data_dir=None, warmup_requests: int = 16, progress: bool = False,
                       write_trace: bool = True, _bench: _Bench | None = None) -> Path:
    """Measure the real engine on the scenario's requests (simpy-free, for the GPU machine).

    First every request arrives at 0 (`realtime=False`): the saturated throughput. Then the
    requests arrive by the wall clock. A fresh executor is warmed up first (its kernel warm-up,
    then `warmup_requests` short requests offline) so no compile stall lands in a timed run.
    `scenario`: a Scenario or a YAML path (with `data_dir`, read through
    `load_validation_scenario`); `trace_df` replaces its requests. Writes under `out_dir`:
    meta.json, trace.csv, saturated/ and realtime/ (summary.json, requests.csv, steps.csv,
    ledger.json). `write_trace=False` leaves trace.csv out (the shared traces' rows; the
    comparison re-derives them from the scenario). Returns `out_dir`.
    """
    from simkv.workload.traces import write_canonical
    from simkv.workload.frames import load_requests_frame
    scn_path = scenario if isinstance(scenario, (str, Path)) else getattr(scenario, "path", None)
    if isinstance(scenario, (str, Path)):
        scenario = load_validation_scenario(scenario, data_dir)
    frame = trace_df if trace_df is not None else load_requests_frame(scenario)
    bench = _bench or _Bench(device, warmup_requests, progress)
    t0 = time.perf_counter()
    runs = bench.measure(scenario, frame)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if write_trace:
        write_canonical(frame, out / "trace.csv")
    for run in RUNS:
        runs[run].write(out / run)
    meta = {
        "scenario": scenario.name,
        "scenario_path": str(scn_path) if scn_path else None,
        "scenario_settings": json.loads(json.dumps(scenario.raw, default=str)),
        "semantics": scenario.semantics,
        "model": scenario.model.name,
        "gpu": scenario.gpu.name,
        "device": device,
        "requests": len(frame),
        "arrival_span_s": float(frame["arrival_s"].max() - frame["arrival_s"].min()),
        "requests_sha256": requests_fingerprint(frame),
        "requests_sha256_no_arrivals": requests_fingerprint(frame, arrivals=False),
        "trace_source": frame.attrs.get("source"),
        "setup": runs["setup"],
        "host_conditions": host_conditions(),
        "measure_wall_s": time.perf_counter() - t0,
        "engine": runs["realtime"].extra["engine"],
        "sizing": runs["realtime"].extra["sizing"],
    }
    for run in RUNS:
        steps = runs[run].steps
        meta[run] = {"duration_s": runs[run].summary["sim_duration_s"],
                     "steps": len(steps),
                     "long_steps": int((steps["duration_s"] > LONG_STEP_S).sum()),
                     "graph_steps": runs[run].extra["engine"]["graph_steps"],
                     "mixed_graph_steps": runs[run].extra["engine"].get("mixed_graph_steps", 0),
                     "eager_steps": runs[run].extra["engine"]["eager_steps"]}
    write_json(out / "meta.json", meta)
    return out


def measure_many(scenario_paths, out_root, device: str = "cuda", *, data_dir=None,
                 warmup_requests: int = 16, progress: bool = False, write_trace: bool = True,
                 pin_cpu: int | None = None) -> list:
    """`measure_validation` for several scenarios into `out_root/<name>/`, sharing one executor
    while the pool allows and one saturated run per request set (time_scale aside).
    `pin_cpu`: run pinned to that CPU (as a profile measured with --pin-cpu)."""
    pin_to_cpu(pin_cpu)
    bench = _Bench(device, warmup_requests, progress)
    outs = []
    for path in scenario_paths:
        scn = load_validation_scenario(path, data_dir)
        t0 = time.perf_counter()
        if scn.tensor_parallel_size > 1:     # one process per rank
            from simkv.validation.tensor_parallel import measure_tensor_parallel
            bench.release()
            outs.append(measure_tensor_parallel(path, Path(out_root) / scn.name, device,
                                                data_dir=data_dir, progress=progress,
                                                write_trace=write_trace))
        else:
            outs.append(measure_validation(scn, Path(out_root) / scn.name, device,
                                           write_trace=write_trace, _bench=bench))
        print(f"[validate] measured {scn.name} in {time.perf_counter() - t0:.1f} s -> "
              f"{outs[-1]}", file=sys.stderr, flush=True)
    bench.release()
    return outs
