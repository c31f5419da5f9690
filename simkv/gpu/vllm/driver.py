"""The scenario's requests served by vLLM's engine in process (AsyncLLM), measured.

    engine = AsyncLLM(the scenario's settings, random weights)         # one per configuration
    warm-up: the first requests, 4 output tokens each, all at 0
    saturated pass: every request at 0                                  -> OUT/saturated/
    real-time pass: each request sent at its arrival time (wall clock)  -> OUT/realtime/
    OUT/meta.json: vLLM, torch, driver, GPU, date, command, requests fingerprint, setup times

The prefix cache is emptied before each pass, so a pass never hits blocks that an earlier one
left. A client coroutine per request sleeps until its arrival, streams its outputs (deltas)
and, where the trace gives `cancel_after_s`, gives up that long after arrival (vLLM aborts it).
A stat logger records each engine step (scheduler and iteration stats). The folder layout is
that of `simkv.validation.measure`, so `simkv validate compare --measured OUT` reads it.

Needs vLLM on a GPU; imports no simpy.
"""
from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from simkv.gpu.vllm.engine_args import engine_kwargs, write_model_dir
from simkv.gpu.vllm.requests import sampling_kwargs, vllm_requests, with_output_cap
from simkv.gpu.vllm.results import requests_frame, steps_frame, summarize

WARMUP_REQUESTS = 16
WARMUP_OUTPUT_TOKENS = 4
PASSES = ("saturated", "realtime")
DRIVER = "simkv.gpu.vllm.driver 1"


def _step_logger_class():
    """A vLLM stat logger that appends one dict per engine step to `sink.steps`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0, sink=None):
            self.sink = sink

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0):
            if scheduler_stats is None:
                return
            details = scheduler_stats.iteration_details
            self.sink.steps.append({
                "t_s": time.perf_counter() - self.sink.t0,
                "num_running": scheduler_stats.num_running_reqs,
                "num_waiting": scheduler_stats.num_waiting_reqs,
                "kv_cache_usage": scheduler_stats.kv_cache_usage,
                "num_preempted": iteration_stats.num_preempted_reqs if iteration_stats else 0,
                "num_prefill_tokens": details.num_ctx_tokens if details else 0,
                "num_decode_tokens": details.num_generation_tokens if details else 0,
                "elapsed_ms": details.elapsed_ms if details else None,
            })

        def log_engine_initialized(self):
            pass

    return StepLogger


class _Sink:
    """What the stat logger writes to: the current pass's steps and its clock origin."""

    def __init__(self):
        self.steps: list = []
        self.t0 = time.perf_counter()


async def _serve_one(engine, req, pass_name: str, t0: float, record: dict, realtime: bool):
    """One client: wait for the arrival, send, stream the outputs into `record`."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    if realtime:
        await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - t0)))
    params = SamplingParams(**sampling_kwargs(req), output_kind=RequestOutputKind.DELTA)
    record["sent_s"] = time.perf_counter() - t0
    events = record["events"]

    async def stream():
        async for out in engine.generate({"prompt_token_ids": list(req.prompt_token_ids)},
                                         params, req.vllm_id(pass_name)):
            now = time.perf_counter() - t0
            for c in out.outputs:
                if c.token_ids:
                    events.append([now, c.index, len(c.token_ids)])
                    if record["first_token_s"] is None:
                        record["first_token_s"] = now
            if out.num_cached_tokens is not None:
                record["cached_tokens"] = out.num_cached_tokens
            if out.finished:
                record["finish_s"] = now
                record["status"] = "completed"

    if req.cancel_after_s == req.cancel_after_s:        # not nan: the client gives up
        deadline = req.arrival_s + req.cancel_after_s
        try:
            await asyncio.wait_for(stream(), max(0.0, deadline - (time.perf_counter() - t0)))
        except asyncio.TimeoutError:
            record["status"] = "cancelled"
            record["finish_s"] = time.perf_counter() - t0
    else:
        await stream()


async def _run_pass(engine, sink: _Sink, requests: list, pass_name: str, realtime: bool):
    """(request records, step records, wall seconds) of one pass."""
    await engine.reset_prefix_cache()
    records = [{"request_id": r.request_id, "arrival_s": r.arrival_s if realtime else 0.0,
                "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "n": r.n,
                "status": "unfinished", "first_token_s": None, "finish_s": None,
                "cached_tokens": None, "events": []} for r in requests]
    sink.steps = []
    t0 = sink.t0 = time.perf_counter()
    await asyncio.gather(*(_serve_one(engine, r, pass_name, t0, rec, realtime)
                           for r, rec in zip(requests, records)))
    wall = time.perf_counter() - t0
    await asyncio.sleep(0.2)     # the last step's stats arrive after its outputs
    return records, list(sink.steps), wall


def write_json(path: Path, data: dict) -> None:
    """`data` as indented JSON, written atomically and readable by all."""
    from simkv.engine.results import atomic_write_text
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")
    path.chmod(0o644)


def _write_pass(out: Path, name: str, pass_name: str, records: list, steps: list, wall: float,
                vllm_blocks: int, block_size: int) -> dict:
    from simkv.engine.results import write_results
    usable = vllm_blocks - 1                 # vLLM's block 0 is the null block, never allocated
    steps_df = steps_frame(steps, usable)
    summary = summarize(records, steps_df, num_blocks=usable, block_size=block_size,
                        wall_time_s=wall, vllm_num_gpu_blocks=vllm_blocks)
    summary.update(name=name, **{"pass": pass_name})
    folder = write_results(out / pass_name, summary, requests_frame(records), steps_df)
    write_json(folder / "ledger.json", {
        "engine": "vllm", "vllm_num_gpu_blocks": vllm_blocks, "usable_blocks": usable,
        "note": "vLLM sizes its pool in its own process; the device memory figures that "
                "simkv's engine records are not available here"})
    write_json(folder / "records.json", {"requests": records, "steps": steps})
    return summary


def _versions() -> dict:
    import torch
    import vllm
    gpu = None
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return {"vllm": vllm.__version__, "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "gpu": gpu, "driver": DRIVER,
            "python": sys.version.split()[0]}


def _freeze_heap() -> float:
    """Collect, then freeze what is alive, so that no full collection walks it during a pass;
    returns the seconds it took. vLLM's engine core and `vllm serve`'s API server freeze their
    heaps; an in-process client (AsyncLLM, this driver) does not, and a full collection of its
    heap (torch and vLLM imported: ~0.85 M objects) held the client up for ~480 ms once per
    pass: no requests sent, no outputs read (profiles/h200/llama-3.1-8b/vllm-0.26/pause-probe)."""
    import gc
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t0


async def _measure(scn, frame, out: Path, warmup_requests: int) -> dict:
    # No top-k/top-p here, so FlashInfer's sampler would never run; without this vLLM 0.26's
    # model runner imports FlashInfer at start-up even then, and the H200 machine has none
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    seed, vocab = scn.seed, scn.model.vocab_size
    sink, setup = _Sink(), {}
    with tempfile.TemporaryDirectory(prefix="simkv-vllm-") as tmp:
        kwargs = engine_kwargs(scn, write_model_dir(scn, tmp))
        logger = _step_logger_class()
        t0 = time.perf_counter()
        engine = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**kwargs),
            stat_loggers=[lambda config, index=0: logger(config, index, sink)])
        setup["engine_build_s"] = time.perf_counter() - t0
        try:
            vllm_blocks = int(engine.vllm_config.cache_config.num_gpu_blocks)
            passes = {}
            if warmup_requests:
                t0 = time.perf_counter()
                warm = with_output_cap(vllm_requests(frame.iloc[:warmup_requests], vocab, seed,
                                                     at_zero=True), WARMUP_OUTPUT_TOKENS)
                await _run_pass(engine, sink, warm, "warmup", realtime=False)
                setup["warmup_s"] = time.perf_counter() - t0
                setup["warmup_requests"] = len(warm)
            for pass_name in PASSES:
                realtime = pass_name == "realtime"
                reqs = vllm_requests(frame, vocab, seed, at_zero=not realtime)
                setup[f"{pass_name}_gc_freeze_s"] = _freeze_heap()
                records, steps, wall = await _run_pass(engine, sink, reqs, pass_name, realtime)
                passes[pass_name] = _write_pass(out, scn.name, pass_name, records, steps, wall,
                                                vllm_blocks, scn.cache.block_size)
                print(f"[vllm] {scn.name} {pass_name}: {len(reqs)} requests in {wall:.1f} s, "
                      f"{len(steps)} steps", file=sys.stderr, flush=True)
        finally:
            engine.shutdown()
    kwargs["model"] = f"(a folder holding {scn.model.name}'s config.json)"
    return {"setup": setup, "engine_kwargs": kwargs, "vllm_num_gpu_blocks": vllm_blocks,
            "passes": passes}


def measure_vllm(scn, frame, out_dir, *, requests_meta: dict,
                 warmup_requests: int = WARMUP_REQUESTS, write_trace: bool = False) -> Path:
    """Serve the scenario's requests (`frame`, a canonical requests frame) on vLLM, saturated
    then in real time, into `out_dir`.

    Writes meta.json (with `requests_meta`: the scenario path and the requests' count, arrival
    span and fingerprints that `simkv validate compare` checks) and saturated/, realtime/
    (summary.json, requests.csv, steps.csv, ledger.json, records.json: the raw records) as
    `simkv validate compare` reads them; with `write_trace`, trace.csv. Returns `out_dir`.
    """
    from simkv.workload.traces import write_canonical
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    run = asyncio.run(_measure(scn, frame, out, warmup_requests))
    if write_trace:
        write_canonical(frame, out / "trace.csv")
    versions = _versions()
    meta = {
        "scenario": scn.name,
        **requests_meta,
        "scenario_settings": json.loads(json.dumps(scn.raw, default=str)),
        # the scheduling rules vLLM itself follows (simkv.semantics names them by release)
        "semantics": "vllm-" + ".".join(str(versions["vllm"]).split(".")[:2]),
        "model": scn.model.name,
        "gpu": scn.gpu.name,
        "device": "cuda",
        "engine": {"name": "vllm", **versions, "engine_kwargs": run["engine_kwargs"],
                   "vllm_num_gpu_blocks": run["vllm_num_gpu_blocks"]},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["simkv", *sys.argv[1:]]) if sys.argv else None,
        "trace_source": frame.attrs.get("source"),
        "setup": run["setup"],
        "measure_wall_s": time.perf_counter() - t0,
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
    }
    for pass_name, summary in run["passes"].items():
        meta[pass_name] = {"duration_s": summary["sim_duration_s"],
                           "steps": summary["num_steps"]}
    write_json(out / "meta.json", meta)
    return out
