"""Validation: the simulator against the real engine, on the same requests.

Split by machine, because the GPU machine has no SimPy:

    measure_validation(scenario, out_dir)      GPU side, simpy-free: the engine serves the
                                               scenario's requests all at t=0 (saturated
                                               throughput), then in real time; both measured
    compare_validation(measured_dir, scenario) CPU side: the simulator (profiled cost model)
                                               serves the same requests; errors, plots, JSON

    error = (simulated - measured) / measured           per metric (ERROR_KEYS)
    load  = offered arrival rate / saturated throughput (requests/s, both on these requests)

A measurement folder holds `meta.json` (scenario, request fingerprint, engine, timings),
`trace.csv` (the canonical window served; never committed, the comparison re-derives it from
the scenario and checks the fingerprint) and `saturated/`, `realtime/` with the engine's
summary.json, requests.csv, steps.csv and ledger.json. steps.csv gains `span_s` (the executor's
CUDA-event span of `execute(plan)`, what the profile measured) and `prep_s` (host input
preparation inside it); `duration_s - span_s` is the engine's host time outside the profile.

Trace workloads on the GPU machine: the shared traces are not there, so `prepare` writes the
scenario's requests (limit applied, time_scale not) as a canonical CSV into a data folder that
travels with the repo, and `load_validation_scenario(path, data_dir)` reads it instead.

    python -m simkv.validate prepare SCENARIO... --data .valdata
    python -m simkv.validate measure SCENARIO... --data .valdata --out results/validation
    python -m simkv.validate compare SCENARIO --measured results/validation/NAME [--out JSON]
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from simkv.core.results import atomic_write_text
from simkv.errors import InputError

ERROR_KEYS = ("ttft_s.mean", "ttft_s.p90", "tpot_s.mean", "e2e_s.mean",
              "throughput_output_tokens_per_s", "preemptions", "running_peak", "num_blocks")
# The bounds on |error| (issue 9): at load <= 0.7, and above it.
BOUNDS = {
    "low": {"ttft_s.mean": 0.05, "ttft_s.p90": 0.05, "tpot_s.mean": 0.03, "e2e_s.mean": 0.03,
            "throughput_output_tokens_per_s": 0.02},
    "high": {"ttft_s.mean": 0.15, "ttft_s.p90": 0.15, "tpot_s.mean": 0.03, "e2e_s.mean": 0.08,
             "throughput_output_tokens_per_s": 0.02},
    "all": {"preemptions": 0.10, "running_peak": 0.10, "num_blocks": 0.02},
}
LOW_LOAD = 0.7
LARGE_BATCH = 128           # decode batches above this are reported apart in the step diagnostic
LONG_STEP_S = 0.25          # a step this long on the GPU is a compile stall or a hiccup
RUNS = ("saturated", "realtime")


# -- scenarios and the request window ------------------------------------------------------------

def window_name(scenario_path) -> str | None:
    """File name of the scenario's request window in a data folder (trace workloads only)."""
    raw = yaml.safe_load(Path(scenario_path).read_text()) or {}
    workload = raw.get("workload") or {}
    trace = workload.get("trace")
    if not trace:
        return None
    limit = workload.get("limit")
    return f"{Path(str(trace)).stem}-{limit if limit else 'all'}.csv"


def prepare_window(scenario_path, data_dir) -> Path | None:
    """Write the scenario's requests (limit applied, arrivals not time-scaled) as a canonical
    CSV under `data_dir`, for a machine without the trace; returns its path (None: synthetic)."""
    from simkv.core.config import load_scenario
    from simkv.core.traces import write_canonical
    from simkv.sim.setup import load_requests_frame
    name = window_name(scenario_path)
    if name is None:
        return None
    scn = load_scenario(scenario_path, overrides={"workload.time_scale": 1.0})
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    return write_canonical(load_requests_frame(scn), data_dir / name)


def load_validation_scenario(scenario_path, data_dir=None):
    """The scenario; with `data_dir` holding its window (see `prepare_window`), the window
    replaces the trace file (format csv; time_scale and limit still apply)."""
    from simkv.core.config import load_scenario
    name = window_name(scenario_path) if data_dir is not None else None
    if name is not None and (Path(data_dir) / name).is_file():
        window = (Path(data_dir) / name).resolve()
        return load_scenario(scenario_path, overrides={"workload.trace": str(window),
                                                       "workload.format": "csv"})
    return load_scenario(scenario_path)


def requests_fingerprint(frame: pd.DataFrame, arrivals: bool = True) -> str:
    """sha256 of the requests a run serves (arrivals to the nanosecond, lengths, n, prefixes,
    cancellations); `arrivals=False` leaves the arrival times out."""
    cols = ["prompt_tokens", "output_tokens", "n", "prefix_block_tokens", "tenant", "adapter"]
    parts = [frame[cols].astype(str).agg(",".join, axis=1),
             frame["prefix_ids"].map(lambda ids: " ".join(map(str, ids))
                                     if isinstance(ids, (tuple, list)) else ""),
             frame["cancel_after_s"].map(lambda v: "" if math.isnan(v) else f"{v:.9f}")]
    if arrivals:
        parts.append(frame["arrival_s"].map(lambda v: f"{v:.9f}"))
    rows = pd.concat(parts, axis=1).astype(str).agg("|".join, axis=1)
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def _scenario(scenario):
    if isinstance(scenario, (str, Path)):
        from simkv.core.config import load_scenario
        return load_scenario(scenario)
    return scenario


# -- GPU side: measure ---------------------------------------------------------------------------

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
        from simkv.gpu.engine import Engine
        from simkv.sim.setup import build_scheduler
        _, sizing = build_scheduler(scn)
        key = self._executor_key(scn, sizing.num_blocks)
        if key != self.executor_key:
            self.release()
            t0 = time.perf_counter()
            engine = Engine(scn, self.device)
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
        return Engine(scn, self.device, executor=self.executor)

    def release(self) -> None:
        if self.executor is None:
            return
        import gc

        import torch
        self.executor = self.executor_key = None
        self.saturated.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

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
                       _bench: _Bench | None = None) -> Path:
    """Measure the real engine on the scenario's requests (simpy-free, for the GPU machine).

    First every request arrives at 0 (`realtime=False`): the saturated throughput. Then the
    requests arrive by the wall clock. A fresh executor is warmed up first (its kernel warm-up,
    then `warmup_requests` short requests offline) so no compile stall lands in a timed run.
    `scenario`: a Scenario or a YAML path (with `data_dir`, read through
    `load_validation_scenario`); `trace_df` replaces its requests. Writes under `out_dir`:
    meta.json, trace.csv, saturated/ and realtime/ (summary.json, requests.csv, steps.csv,
    ledger.json). Returns `out_dir`.
    """
    from simkv.core.traces import write_canonical
    from simkv.sim.setup import load_requests_frame
    scn_path = scenario if isinstance(scenario, (str, Path)) else getattr(scenario, "path", None)
    if isinstance(scenario, (str, Path)):
        scenario = load_validation_scenario(scenario, data_dir)
    frame = trace_df if trace_df is not None else load_requests_frame(scenario)
    bench = _bench or _Bench(device, warmup_requests, progress)
    t0 = time.perf_counter()
    runs = bench.measure(scenario, frame)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_canonical(frame, out / "trace.csv")
    for run in RUNS:
        runs[run].write(out / run)
    meta = {
        "scenario": scenario.name,
        "scenario_path": str(scn_path) if scn_path else None,
        "scenario_settings": json.loads(json.dumps(scenario.raw, default=str)),
        "model": scenario.model.name,
        "gpu": scenario.gpu.name,
        "device": device,
        "requests": len(frame),
        "arrival_span_s": float(frame["arrival_s"].max() - frame["arrival_s"].min()),
        "requests_sha256": requests_fingerprint(frame),
        "requests_sha256_no_arrivals": requests_fingerprint(frame, arrivals=False),
        "trace_source": frame.attrs.get("source"),
        "setup": runs["setup"],
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
    _write_json(out / "meta.json", meta)
    return out


def measure_many(scenario_paths, out_root, device: str = "cuda", *, data_dir=None,
                 warmup_requests: int = 16, progress: bool = False) -> list:
    """`measure_validation` for several scenarios into `out_root/<name>/`, sharing one executor
    while the pool allows and one saturated run per request set (time_scale aside)."""
    bench = _Bench(device, warmup_requests, progress)
    outs = []
    for path in scenario_paths:
        scn = load_validation_scenario(path, data_dir)
        t0 = time.perf_counter()
        outs.append(measure_validation(scn, Path(out_root) / scn.name, device, _bench=bench))
        print(f"[validate] measured {scn.name} in {time.perf_counter() - t0:.1f} s -> "
              f"{outs[-1]}", file=sys.stderr, flush=True)
    bench.release()
    return outs


# -- CPU side: compare ---------------------------------------------------------------------------

def _read_run(folder: Path) -> dict:
    return {"summary": json.loads((folder / "summary.json").read_text()),
            "requests": pd.read_csv(folder / "requests.csv"),
            "steps": pd.read_csv(folder / "steps.csv"),
            "ledger": json.loads((folder / "ledger.json").read_text())
            if (folder / "ledger.json").is_file() else {}}


def _get(summary: dict, key: str):
    value = summary
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def relative_error(simulated, measured) -> float | None:
    """(simulated - measured) / measured; 0 when both are 0; None when undefined."""
    if simulated is None or measured is None:
        return None
    simulated, measured = float(simulated), float(measured)
    if not (math.isfinite(simulated) and math.isfinite(measured)):
        return None
    if measured == 0:
        return 0.0 if simulated == 0 else None
    return (simulated - measured) / measured


def ledger_num_blocks(ledger: dict, scenario, bytes_per_block: int) -> int | None:
    """Blocks the engine's measured memory leaves for KV at the scenario's budget: (budget -
    the device's peak use outside the KV pool) // bytes per block, the budget taken on the
    device's own total as vLLM does. None without a device ledger."""
    total, peak = ledger.get("device_memory_bytes"), ledger.get("device_used_peak_bytes")
    pool = ledger.get("kv_pool_bytes")
    if not total or not peak or pool is None:
        return None
    cache = scenario.cache
    budget = (cache.memory_budget_gib * (1 << 30) if cache.memory_budget_gib
              else cache.gpu_memory_utilization * total)
    return int((budget - (peak - pool)) // bytes_per_block)


class _PlanReplay:
    """Cost model for the diagnostic: while the simulator's plans match the engine's steps
    (same index, same prefill and decode tokens) it advances the clock to the engine's next step
    start (or by the step's duration before an idle gap), so arrivals meet the same steps and
    both runs keep the same schedule; it records what the model predicted for each such plan."""

    IDLE_GAP_S = 1e-3        # a longer gap between two engine steps was a wait for arrivals

    def __init__(self, inner, steps: pd.DataFrame):
        self.inner, self.name = inner, inner.name
        self.tokens = list(zip(steps["num_prefill_tokens"].astype(int).tolist(),
                               steps["num_decode_tokens"].astype(int).tolist()))
        self.start_s = steps["start_s"].to_numpy(dtype=np.float64)
        self.duration_s = steps["duration_s"].to_numpy(dtype=np.float64)
        self.span_s = (steps["span_s"].to_numpy(dtype=np.float64) if "span_s" in steps
                       else np.full(len(steps), np.nan))
        self.rows = []
        self.matching = True

    def predict(self, plan) -> float:
        predicted = self.inner.predict(plan)
        k = len(self.rows)
        if self.matching and k < len(self.tokens) \
                and self.tokens[k] == (plan.num_prefill_tokens, plan.num_decode_tokens):
            decodes = len(plan.scheduled) - plan.num_prefill_seqs
            layout = getattr(self.inner, "layout", None)
            graphed = layout.is_graphed(plan.num_prefill_tokens, decodes) if layout is not None \
                else plan.num_prefill_tokens == 0 and decodes <= 256
            kind = ("eager" if not graphed else
                    "mixed_graph" if plan.num_prefill_tokens else "decode_graph")
            self.rows.append((predicted, self.duration_s[k], self.span_s[k], kind,
                              len(plan.scheduled), plan.num_prefill_tokens, decodes))
            end = self.start_s[k] + self.duration_s[k]
            if k + 1 < len(self.start_s) and self.start_s[k + 1] - end < self.IDLE_GAP_S:
                return max(1e-9, float(self.start_s[k + 1] - plan.now_s))
            return max(1e-9, float(end - plan.now_s))
        self.matching = False
        return predicted


def _step_diagnostics(scenario, frame, measured: dict, cost_model) -> dict:
    """Per-step error of the cost model on the engine's own plans (the simulator replays the
    engine's step times; `matched_steps` of `steps` kept the same schedule), against the step's
    duration and against the executor span the profile measured; the engine's host time outside
    that span; and `replayed_error`: the replay's metrics against the measured ones (near zero
    when the simulator and the engine make the same decisions, so that the headline errors are
    step-time errors)."""
    from simkv.sim.engine import simulate
    steps = measured["steps"]
    replay = _PlanReplay(cost_model, steps)
    replayed = simulate(scenario, trace_df=frame, cost_model=replay).summary
    out = {"steps": int(len(steps)), "matched_steps": len(replay.rows),
           "host_outside_span_fraction": _outside_fraction(steps),
           "replayed_error": {k: relative_error(_get(replayed, k), _get(measured["summary"], k))
                              for k in ERROR_KEYS[:5]}}
    rows = pd.DataFrame(replay.rows, columns=["predicted_s", "duration_s", "span_s", "kind",
                                              "num_seqs", "num_prefill_tokens", "num_decodes"])
    if rows.span_s.notna().all() and len(rows) >= 3:
        out["host_outside_span_fit"] = _fit_host_term(rows)
    large = rows.num_decodes > LARGE_BATCH
    families = [(kind, rows[rows.kind == kind]) for kind in ("decode_graph", "mixed_graph",
                                                             "eager")]
    families += [(f"{kind}_over_{LARGE_BATCH}_decodes", rows[(rows.kind == kind) & large])
                 for kind in ("decode_graph", "eager")]
    for family, part in families:
        if part.empty:
            continue
        entry = {"steps": int(len(part)),
                 "time_fraction": float(part.duration_s.sum() / rows.duration_s.sum()),
                 "duration_ms_mean": 1e3 * float(part.duration_s.mean()),
                 "predicted_ms_mean": 1e3 * float(part.predicted_s.mean()),
                 "error_vs_duration_median": float((part.predicted_s / part.duration_s - 1)
                                                   .median()),
                 "error_vs_duration_total": float(part.predicted_s.sum()
                                                  / part.duration_s.sum() - 1)}
        if part.span_s.notna().all():
            entry["span_ms_mean"] = 1e3 * float(part.span_s.mean())
            entry["error_vs_span_median"] = float((part.predicted_s / part.span_s - 1).median())
            entry["error_vs_span_total"] = float(part.predicted_s.sum() / part.span_s.sum() - 1)
            entry["host_outside_span_ms_mean"] = 1e3 * float((part.duration_s
                                                              - part.span_s).mean())
        out[family] = entry
    return out


def _fit_host_term(rows: pd.DataFrame) -> dict:
    """Least squares of the host time outside the executor span per step: c0_s + c_seq_s x
    sequences + c_prefill_token_s x prefill tokens (the term the profiled model lacks)."""
    x = np.c_[np.ones(len(rows)), rows.num_seqs, rows.num_prefill_tokens].astype(np.float64)
    coef, *_ = np.linalg.lstsq(x, (rows.duration_s - rows.span_s).to_numpy(), rcond=None)
    return dict(zip(("c0_s", "c_seq_s", "c_prefill_token_s"), map(float, np.maximum(coef, 0))))


def compare_validation(measured_dir, scenario, out=None, *, plots: bool = True,
                       diagnostics: bool = True) -> dict:
    """Simulate the measured requests with the scenario's cost model and compare (CPU side).

    Writes `out` (default `profiles/<gpu>/<model>/validation/<name>.json`) with `model`, `gpu`,
    `load`, `measured` and `simulated` summaries, `error` per ERROR_KEYS, the saturated runs'
    comparison, sizing, per-step diagnostics and the issue's bounds; with `plots`, PNGs beside
    it: `<name>-ttft-cdf.png`, `<name>-tpot-cdf.png`, `<name>-e2e-scatter.png`. Returns the
    JSON's dict. Raises InputError when the requests differ from those measured.
    """
    from simkv.core.specs import profiles_dir
    from simkv.core.traces import load_trace
    from simkv.sim.engine import simulate
    from simkv.sim.setup import build_cost_model, build_scheduler, load_requests_frame
    measured_dir = Path(measured_dir)
    if not (measured_dir / "meta.json").is_file():
        raise InputError(f"{measured_dir}: no meta.json (a folder written by the measuring half: "
                         "simkv validate SCENARIO --device cuda)")
    meta = json.loads((measured_dir / "meta.json").read_text())
    scn = _scenario(scenario)
    window = measured_dir / "trace.csv"
    frame = (load_trace(window, format="csv") if window.is_file()
             else load_requests_frame(scn))
    if requests_fingerprint(frame) != meta["requests_sha256"]:
        raise InputError(f"{measured_dir}: the scenario's requests ({len(frame)}) differ from "
                         f"those measured ({meta['requests']}); check workload.trace, limit and "
                         "time_scale")
    runs = {run: _read_run(measured_dir / run) for run in RUNS}
    measured = runs["realtime"]["summary"]
    _, sizing = build_scheduler(scn)
    # The simulator serves the pool the engine served: `num_blocks` (below) checks the sizing
    # on its own, and a profile re-measured since the run must not change the pool compared.
    served_blocks = int(measured.get("num_blocks") or 0)
    if served_blocks and served_blocks != sizing.num_blocks \
            and scn.cache.num_gpu_blocks_override is None:
        from simkv.core.config import with_overrides
        scn = with_overrides(scn, {"cache.num_gpu_blocks_override": served_blocks})
    cost_model = build_cost_model(scn)
    sim = simulate(scn, trace_df=frame, cost_model=cost_model)
    simulated = dict(sim.summary)
    at_zero = frame.copy()
    at_zero["arrival_s"] = 0.0
    sim_sat = simulate(scn, trace_df=at_zero, cost_model=cost_model).summary

    sat_rps = runs["saturated"]["summary"]["throughput_requests_per_s"]
    span = meta["arrival_span_s"]
    offered = len(frame) / span if span > 0 else None
    ledger_blocks = ledger_num_blocks(runs["realtime"]["ledger"], scn, sizing.bytes_per_block)
    engine_blocks = ledger_blocks if ledger_blocks is not None else measured["num_blocks"]
    error = {}
    for key in ERROR_KEYS:
        if key == "num_blocks":
            error[key] = relative_error(sizing.num_blocks, engine_blocks)
        else:
            error[key] = relative_error(_get(simulated, key), _get(measured, key))
    load = offered / sat_rps if offered and sat_rps else None
    result = {
        "name": scn.name,
        "model": scn.model.name,
        "gpu": scn.gpu.name,
        "scenario": meta.get("scenario_path"),
        "measured_dir": str(measured_dir),
        "cost_model": cost_model.name,
        "requests": len(frame),
        "load": load,
        "offered_rate_rps": offered,
        "saturated_throughput_rps": sat_rps,
        "error": error,
        "bounds": check_bounds(error, load),
        "measured": measured,
        "simulated": simulated,
        "saturated": {
            "measured": runs["saturated"]["summary"], "simulated": sim_sat,
            "error": {k: relative_error(_get(sim_sat, k), _get(runs["saturated"]["summary"], k))
                      for k in ("throughput_requests_per_s", "throughput_output_tokens_per_s",
                                "sim_duration_s", "tpot_s.mean", "running_peak")}},
        "sizing": {"simkv_size_num_blocks": sizing.num_blocks,
                   "engine_allocated_num_blocks": measured["num_blocks"],
                   "engine_ledger_num_blocks": ledger_blocks,
                   "note": "num_blocks error: simkv size against the blocks the engine's measured "
                           "peak memory leaves at the same budget (the allocated pool when the "
                           "run has no device ledger); the engine allocates what simkv size says"},
        "measurement": {k: meta.get(k) for k in ("device", "engine", "setup", "saturated",
                                                 "realtime", "requests_sha256")},
    }
    if diagnostics:
        result["steps"] = {run: _step_diagnostics(scn, frame if run == "realtime" else at_zero,
                                                  runs[run], cost_model)
                           for run in RUNS}
        # the engine's time outside the executor, as the profile's engine pass measured it
        result["steps"]["profile_engine_host"] = getattr(cost_model, "engine_host", None)
    out = Path(out) if out is not None else (profiles_dir() / scn.gpu.name / scn.model.name
                                             / "validation" / f"{scn.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if plots:
        result["plots"] = [p.name for p in write_plots(runs["realtime"]["requests"],
                                                       sim.requests, out.parent, out.stem)]
    _write_json(out, result)
    return result


def _outside_fraction(steps: pd.DataFrame) -> float | None:
    if "span_s" not in steps or steps["span_s"].isna().any():
        return None
    return float((steps["duration_s"] - steps["span_s"]).sum() / steps["duration_s"].sum())


def check_bounds(error: dict, load) -> dict:
    """The issue's bounds on |error|: {metric: {bound, error, ok}} and `all_ok`."""
    regime = "low" if load is not None and load <= LOW_LOAD else "high"
    out = {"regime": f"load <= {LOW_LOAD}" if regime == "low" else f"load > {LOW_LOAD}"}
    ok = True
    for key, bound in {**BOUNDS[regime], **BOUNDS["all"]}.items():
        value = error.get(key)
        passed = value is not None and abs(value) <= bound
        out[key] = {"bound": bound, "ok": passed}
        ok &= passed
    out["all_ok"] = ok
    return out


def write_plots(measured: pd.DataFrame, simulated: pd.DataFrame, folder, name: str) -> list:
    """TTFT and TPOT CDF overlays and a per-request e2e scatter (small PNGs); returns paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    folder = Path(folder)
    paths = []
    m = measured[measured["status"] == "completed"]
    s = simulated[simulated["status"] == "completed"]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        fig, ax = plt.subplots(figsize=(4.2, 3.0), dpi=80)
        for df, who, style in ((m, "measured", "-"), (s, "simulated", "--")):
            values = np.sort(df[key].dropna().to_numpy() * 1e3)
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), style, where="post",
                        label=who, lw=1.4)
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name}: {label}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, folder / f"{name}-{key.split('_')[0]}-cdf.png"))
    joined = m[["request_id", "e2e_s"]].merge(s[["request_id", "e2e_s"]], on="request_id",
                                             suffixes=("_measured", "_simulated"))
    fig, ax = plt.subplots(figsize=(3.6, 3.4), dpi=80)
    ax.scatter(joined.e2e_s_measured, joined.e2e_s_simulated, s=4, alpha=0.5, lw=0)
    top = float(np.nanmax(joined[["e2e_s_measured", "e2e_s_simulated"]].to_numpy(), initial=1e-3))
    ax.plot([0, top], [0, top], "k:", lw=1)
    ax.set_xlabel("measured e2e (s)")
    ax.set_ylabel("simulated e2e (s)")
    ax.set_title(f"{name}: per request", fontsize=9)
    paths.append(_save(fig, folder / f"{name}-e2e-scatter.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# -- the command ---------------------------------------------------------------------------------

def validate_command(scenario_path, device: str = "cuda", out_dir=None, measured_dir=None,
                     *, data_dir=None, strict: bool = False) -> int:
    """`simkv validate SCENARIO --device cuda|cpu [--out DIR] [--measured DIR] [--data DIR]`.

    Without `measured_dir`: measures into `out_dir/<name>/` (default results/validation/<name>),
    then, where simpy is installed, compares; without simpy it says so and stops after
    measuring. With `measured_dir`: compares only (no GPU). The comparison is written to
    `out_dir/<name>.json` when `out_dir` is given, else
    profiles/<gpu>/<model>/validation/<name>.json. Returns the exit code: 0, or 1 when
    `strict` and an error exceeds the issue's bounds.
    """
    if measured_dir is None:
        scn = load_validation_scenario(scenario_path, data_dir)
        measured_dir = Path(out_dir or Path("results") / "validation") / scn.name
        measure_validation(scn, measured_dir, device)
        print(f"measured: {measured_dir}")
        if importlib.util.find_spec("simpy") is None:
            print("simpy is not installed here: measured only. Compare on a machine with simpy:\n"
                  f"  simkv validate {scenario_path} --measured {measured_dir}")
            return 0
    else:
        scn = load_validation_scenario(scenario_path, data_dir)
    out = Path(out_dir) / f"{scn.name}.json" if out_dir is not None else None
    result = compare_validation(measured_dir, scn, out)
    print(format_table([result]))
    return 1 if strict and not result["bounds"]["all_ok"] else 0


def format_table(results: list) -> str:
    """A markdown table: one row per validation result."""
    keys = ERROR_KEYS
    head = "| scenario | load | " + " | ".join(keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 2)]
    for r in results:
        cells = [_pct(r["error"].get(k)) + ("" if r["bounds"].get(k, {}).get("ok", True)
                                            else " ✗") for k in keys]
        load = f"{r['load']:.2f}" if r["load"] is not None else "-"
        lines.append(f"| {r['name']} | {load} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, default=_plain) + "\n")
    path.chmod(0o644)          # the atomic writer's temp file is private (0600)


def _plain(value):
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return None if math.isnan(value) else float(value)
    if isinstance(value, (Path, tuple)):
        return str(value) if isinstance(value, Path) else list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simkv.validate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("prepare", help="write trace windows for a machine without the traces")
    p.add_argument("scenarios", nargs="+")
    p.add_argument("--data", default=".valdata")
    p = sub.add_parser("measure", help="GPU side: measure scenarios into OUT/<name>/")
    p.add_argument("scenarios", nargs="+")
    p.add_argument("--data", default=None)
    p.add_argument("--out", default="results/validation")
    p.add_argument("--device", default="cuda")
    p.add_argument("--progress", action="store_true")
    p = sub.add_parser("compare", help="CPU side: compare a measurement with the simulator")
    p.add_argument("scenario")
    p.add_argument("--measured", required=True)
    p.add_argument("--out", default=None, help="JSON path (default profiles/<gpu>/<model>/"
                   "validation/<name>.json)")
    args = parser.parse_args(argv)
    try:
        if args.verb == "prepare":
            for path in args.scenarios:
                print(prepare_window(path, args.data) or f"{path}: synthetic, nothing to write")
        elif args.verb == "measure":
            measure_many(args.scenarios, args.out, args.device, data_dir=args.data,
                         progress=args.progress)
        else:
            result = compare_validation(args.measured, load_validation_scenario(args.scenario),
                                        args.out)
            print(format_table([result]))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
