"""CPU side of the validation: the simulator (profiled cost model) serves the requests the
engine served; errors against the measurement, sizing, diagnostics and plots, written as JSON.
"""
from __future__ import annotations

import json
from pathlib import Path

from simkv.errors import InputError
from simkv.validation.data import RUNS, read_run, requests_fingerprint, write_json
from simkv.validation.diagnostics import step_diagnostics
from simkv.validation.metrics import ERROR_KEYS, check_bounds, lookup, relative_error
from simkv.validation.plots import write_plots


def _scenario(scenario):
    if isinstance(scenario, (str, Path)):
        from simkv.config.scenario import load_scenario
        return load_scenario(scenario)
    return scenario


def ledger_num_blocks(ledger: dict, scenario, bytes_per_block: int) -> int | None:
    """Blocks the engine's measured memory leaves for KV at the scenario's budget: (budget -
    the device's peak use outside the KV pool) // bytes per block, the budget taken on the
    device's own total as vLLM does, and counted by the scenario's pool-sizing rule as
    `simkv size` counts it: under `cache.pool_sizing: vllm` the measured CUDA-graph pool and
    the allocator's slack at the peak (`unattributed_bytes`) lie outside the budget
    (simkv.sizing.OUTSIDE_VLLM_BUDGET), under `engine` inside it. None without a device
    ledger."""
    total, peak = ledger.get("device_memory_bytes"), ledger.get("device_used_peak_bytes")
    pool = ledger.get("kv_pool_bytes")
    if not total or not peak or pool is None:
        return None
    cache = scenario.cache
    budget = (cache.memory_budget_gib * (1 << 30) if cache.memory_budget_gib
              else cache.gpu_memory_utilization * total)
    outside_kv = peak - pool
    if cache.pool_sizing == "vllm":
        outside_kv -= (ledger.get("graph_pool_bytes") or 0) \
            + max(0, ledger.get("unattributed_bytes") or 0)
    return int((budget - outside_kv) // bytes_per_block)


CALIBRATION_ROUNDS = 2     # the duration is nearly proportional to the scale (the clock state
                           # and cancellation timers bend it a little): a second round settles it


def _calibrated(scn, cost_model, at_zero, saturated: dict) -> tuple:
    """(scenario, cost model, calibration) with the step times scaled so that the simulated
    all-at-zero run lasts as long as the measured saturated one."""
    from simkv.config.scenario import with_overrides
    from simkv.sim.engine import simulate
    from simkv.costmodel import load_cost_model
    measured_s = saturated["summary"].get("sim_duration_s")
    if not isinstance(measured_s, (int, float)) or measured_s <= 0:
        raise InputError("calibration needs the saturated run's duration (saturated/"
                         "summary.json sim_duration_s)")
    base, first_s = scn.step_time_scale, None
    for _ in range(CALIBRATION_ROUNDS):
        simulated_s = simulate(scn, trace_df=at_zero,
                               cost_model=cost_model).summary["sim_duration_s"]
        if not simulated_s or simulated_s <= 0:
            raise InputError("calibration needs a simulated all-at-zero run that takes time")
        first_s = first_s or simulated_s
        scn = with_overrides(scn, {"step_time_scale": scn.step_time_scale
                                   * measured_s / simulated_s})
        cost_model = load_cost_model(scn)
    return scn, cost_model, {
        "step_time_scale": scn.step_time_scale / base, "saturated_measured_s": measured_s,
        "saturated_simulated_s": first_s,
        "note": "step times scaled so that the simulated all-at-zero run lasts as long as the "
                "measured saturated run (the same requests, offline, on the same GPU)"}


def _measured_requests(measured_dir: Path, scenario):
    """(meta.json, the scenario, the requests frame) of a measurement folder, the requests
    checked to be those the scenario gives."""
    from simkv.workload.frames import load_requests_frame
    from simkv.workload.traces import load_trace
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
    return meta, scn, frame


def measured_semantics(meta: dict) -> str:
    """The scheduling rules a measurement ran under: as its meta.json records them; before
    they were recorded, vllm-0.26 for vLLM v0.26 itself and vllm-0.18 for simkv's engine."""
    from simkv import semantics as rules
    if meta.get("semantics"):
        return meta["semantics"]
    engine = meta.get("engine") or {}
    if engine.get("name") == "vllm" and str(engine.get("vllm", "")).startswith("0.26"):
        return "vllm-0.26"
    return rules.MEASURED_SEMANTICS


def measured_async(meta: dict) -> bool:
    """Whether the engine measured scheduled asynchronously: vLLM v0.26 does by default
    (unless its engine arguments turned it off); simkv's engine never does."""
    engine = meta.get("engine") or {}
    if engine.get("name") != "vllm":
        return False
    return (engine.get("engine_kwargs") or {}).get("async_scheduling", True) is not False


def _as_measured(scn, meta: dict):
    """`scn` under the rules the measurement ran under (simkv.semantics), asynchronous
    scheduling included."""
    overrides = {}
    semantics = measured_semantics(meta)
    if scn.semantics != semantics:
        overrides["semantics"] = semantics
    if measured_async(meta) != scn.scheduler.async_scheduling:
        overrides["scheduler.async_scheduling"] = measured_async(meta)
    if not overrides:
        return scn
    from simkv.config.scenario import with_overrides
    return with_overrides(scn, overrides)


def _served_pool(scn, measured: dict):
    """`scn` serving the pool the engine served: `num_blocks` checks the sizing on its own, and
    a profile re-measured since the run must not change the pool compared."""
    from simkv.config.scenario import with_overrides
    from simkv.sizing import size_scenario
    # the sizing alone: a KV manager of an unlimited pool (a tiny model on an H200: 130 million
    # blocks) would take gigabytes just to be thrown away
    sizing = size_scenario(scn)
    served_blocks = int(measured.get("num_blocks") or 0)
    if served_blocks and served_blocks != sizing.num_blocks \
            and scn.cache.num_gpu_blocks_override is None:
        scn = with_overrides(scn, {"cache.num_gpu_blocks_override": served_blocks})
    return scn, sizing


def _errors(sizing, engine_blocks, simulated: dict, measured: dict) -> dict:
    """Relative error of each of ERROR_KEYS (num_blocks: the sizing against the engine's)."""
    error = {}
    for key in ERROR_KEYS:
        if key == "num_blocks":
            error[key] = relative_error(sizing.num_blocks, engine_blocks)
        else:
            error[key] = relative_error(lookup(simulated, key), lookup(measured, key))
    return error


def _saturated(measured: dict, simulated: dict) -> dict:
    """The saturated runs side by side, with the relative errors of their throughput, duration,
    TPOT and peak running count."""
    return {"measured": measured, "simulated": simulated,
            "error": {k: relative_error(lookup(simulated, k), lookup(measured, k))
                      for k in ("throughput_requests_per_s", "throughput_output_tokens_per_s",
                                "sim_duration_s", "tpot_s.mean", "running_peak")}}


SIZING_NOTE = ("num_blocks error: simkv size against the blocks the engine's measured "
               "peak memory leaves at the same budget (the allocated pool when the "
               "run has no device ledger); the engine allocates what simkv size says")


def _steps(scn, frame, at_zero, runs: dict, cost_model) -> dict:
    """Per-step diagnostics of each run, and the profile's host terms beside them."""
    steps = {run: step_diagnostics(scn, frame if run == "realtime" else at_zero, runs[run],
                                   cost_model)
             for run in RUNS}
    # the engine's time outside the executor, as the profile's engine pass measured it
    steps["profile_engine_host"] = getattr(cost_model, "engine_host", None)
    # and as its serving pass measured it (what the model charges instead, where present)
    steps["profile_serving_host"] = getattr(cost_model, "serving_host", None)
    return steps


def compare_validation(measured_dir, scenario, out=None, *, plots: bool = True,
                       diagnostics: bool = True, calibrate: bool = False) -> dict:
    """Simulate the measured requests with the scenario's cost model and compare (CPU side).

    `calibrate`: first scale every step time (`step_time_scale`) so that the simulated
    all-at-zero run lasts as long as the measured saturated run (the same requests on the same
    GPU, offline), then compare: the simulator calibrated to this GPU by one offline run
    (`calibration` in the JSON). Without it, the profile alone.

    Writes `out` (default `profiles/<gpu>/<model>/validation/<name>.json`) with `model`, `gpu`,
    `load`, `measured` and `simulated` summaries, `error` per ERROR_KEYS, the saturated runs'
    comparison, sizing, per-step diagnostics and the issue's bounds; with `plots`, PNGs beside
    it: `<name>-ttft-cdf.png`, `<name>-tpot-cdf.png`, `<name>-e2e-scatter.png`. Returns the
    JSON's dict. Raises InputError when the requests differ from those measured.
    """
    from simkv.costmodel import load_cost_model
    from simkv.sim.engine import simulate
    measured_dir = Path(measured_dir)
    meta, scn, frame = _measured_requests(measured_dir, scenario)
    scn = _as_measured(scn, meta)
    runs = {run: read_run(measured_dir / run) for run in RUNS}
    measured = runs["realtime"]["summary"]
    scn, sizing = _served_pool(scn, measured)
    cost_model = load_cost_model(scn)
    at_zero = frame.assign(arrival_s=0.0)
    calibration = None
    if calibrate:
        scn, cost_model, calibration = _calibrated(scn, cost_model, at_zero, runs["saturated"])
    sim = simulate(scn, trace_df=frame, cost_model=cost_model)
    simulated = dict(sim.summary)
    sim_sat = simulate(scn, trace_df=at_zero, cost_model=cost_model).summary

    sat_rps = runs["saturated"]["summary"]["throughput_requests_per_s"]
    offered = len(frame) / meta["arrival_span_s"] if meta["arrival_span_s"] > 0 else None
    ledger_blocks = ledger_num_blocks(runs["realtime"]["ledger"], scn, sizing.bytes_per_block)
    engine_blocks = ledger_blocks if ledger_blocks is not None else measured["num_blocks"]
    error = _errors(sizing, engine_blocks, simulated, measured)
    load = offered / sat_rps if offered and sat_rps else None
    result = {
        "name": scn.name, "model": scn.model.name, "gpu": scn.gpu.name,
        "scenario": meta.get("scenario_path"), "measured_dir": str(measured_dir),
        "cost_model": cost_model.name, "semantics": scn.semantics,
        "async_scheduling": scn.scheduler.async_scheduling,
        "calibration": calibration, "requests": len(frame),
        "load": load, "offered_rate_rps": offered, "saturated_throughput_rps": sat_rps,
        "error": error, "bounds": check_bounds(error, load),
        "measured": measured, "simulated": simulated,
        "saturated": _saturated(runs["saturated"]["summary"], sim_sat),
        "sizing": {"simkv_size_num_blocks": sizing.num_blocks,
                   "engine_allocated_num_blocks": measured["num_blocks"],
                   "engine_ledger_num_blocks": ledger_blocks, "note": SIZING_NOTE},
        "measurement": {k: meta.get(k) for k in ("device", "engine", "setup", "saturated",
                                                 "realtime", "requests_sha256")},
    }
    if diagnostics:
        result["steps"] = _steps(scn, frame, at_zero, runs, cost_model)
    _write(result, out, scn, plots, runs["realtime"]["requests"], sim.requests)
    return result


def _write(result: dict, out, scn, plots: bool, measured_requests, simulated_requests) -> None:
    """Write the result JSON to `out` (default: the profile's validation folder); with `plots`,
    the plots beside it (their names go into the result)."""
    from simkv.specs import profiles_dir
    out = Path(out) if out is not None else (profiles_dir() / scn.gpu.name / scn.model.name
                                             / "validation" / f"{scn.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if plots:
        result["plots"] = [p.name for p in write_plots(measured_requests, simulated_requests,
                                                       out.parent, out.stem)]
    write_json(out, result)
