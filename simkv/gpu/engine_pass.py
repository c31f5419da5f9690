"""The profiler's engine passes: the engine's own time per step outside the executor.

The real engine (scheduler, KV manager, executor) serves a synthetic workload offline at block
size 16; per step, `duration_s - exec_s` is the time spent scheduling, finishing the step and
recording metrics, which the fit turns into `engine_host` (`simkv.fitting.fit`).

The optional serving pass (`measure_serving_host`) serves the same kind of workload by the wall
clock, arrivals at SERVING_LOAD of the offline pass's throughput, and keeps the host input
preparation inside the executor's span too (`prep_s`): the host as it runs between real-time
steps, which the offline pass and the profile's timing loop do not see (the validation leases
differed by a factor of two in it; docs/validation.md). The fit turns it into `serving_host`.
"""
from __future__ import annotations

import gc
import time

import numpy as np

from simkv.profile.format import ENGINE_PASS_BLOCK_SIZE
from simkv.sizing import PROFILE_ENGINE_BATCHED_TOKENS

ENGINE_FIELDS = ["step", "num_seqs", "num_prefill_tokens", "num_decode_tokens", "preempted",
                 "duration_s", "exec_s", "outside_s"]

ENGINE_PASS_NOTE = ("engine_host.csv: the real engine (scheduler, KV manager, executor) serving "
                    "a synthetic workload offline at block size 16; per step the time outside "
                    "the executor's span (scheduling, finishing, metrics) = duration_s - exec_s")
ENGINE_PASS_REQUESTS = 240
SERVING_FIELDS = ["step", "start_s", "num_seqs", "num_prefill_tokens", "num_decode_tokens",
                  "preempted", "duration_s", "exec_s", "prep_s", "outside_s"]
SERVING_LOAD = 0.6            # arrival rate of the serving pass / the offline pass's throughput
SERVING_REQUESTS = 400
SERVING_PASS_NOTE = ("serving_host.csv: the real engine serving a synthetic workload by the wall "
                     "clock at block size 16 (Poisson arrivals at `serving_pass.rate_rps`); per "
                     "step the executor's span (exec_s), the host input preparation inside it "
                     "(prep_s) and the time outside it (outside_s = duration_s - exec_s)")


def engine_workload(num_requests: int, seed: int, rate_rps: float | None = None):
    """A synthetic serving mix for the engine passes: lognormal prompts (median 400 tokens) and
    outputs (median 80), a quarter sharing one of four 256-token prefixes, a tenth with n = 2;
    all arriving at 0, or with `rate_rps` as a Poisson process from 0."""
    from simkv.workload.traces import build_trace
    rng = np.random.default_rng(seed + 17)
    prompts = np.clip(rng.lognormal(np.log(400), 0.9, num_requests), 16, 4000).astype(int)
    outputs = np.clip(rng.lognormal(np.log(80), 0.8, num_requests), 4, 400).astype(int)
    groups = rng.integers(0, 4, num_requests)
    shared = rng.random(num_requests) < 0.25
    ids, next_id = [], 1000
    for i in range(num_requests):
        blocks = -(-int(prompts[i]) // 16)
        head = tuple(range(10 * groups[i], 10 * groups[i] + 16))[:blocks] if shared[i] else ()
        ids.append(head + tuple(range(next_id, next_id + blocks - len(head))))
        next_id += blocks
    arrivals = np.zeros(num_requests)
    if rate_rps:
        gaps = np.random.default_rng(seed + 29).exponential(1.0 / rate_rps, num_requests)
        arrivals = np.cumsum(gaps) - gaps[0]
    return build_trace({"arrival_s": arrivals, "prompt_tokens": prompts,
                        "output_tokens": outputs, "n": np.where(rng.random(num_requests) < 0.1,
                                                                2, 1),
                        "prefix_ids": ids, "prefix_block_tokens": [16] * num_requests},
                       source="profiler", format="csv")


def pass_num_blocks(model, free_bytes: int) -> int:
    """The passes' pool: the blocks half of `free_bytes` holds, at most 40,000. A block of a
    window hybrid holds a page of its group's layers only (simkv.kv_geometry; Gemma 3 27B:
    10 of 62 layers), so that the pool holds a max_model_len request over its groups."""
    from simkv.kv_geometry import kv_geometry
    per_block = kv_geometry(model, model.kv_bytes_per_layer_token("bf16"),
                            ENGINE_PASS_BLOCK_SIZE, model.max_position_embeddings).bytes_per_block
    return int(min(40_000, 0.5 * free_bytes // per_block))


def pass_scenario(model, seed: int, name: str, gpu: str, max_num_seqs: int, num_blocks: int):
    """The passes' scenario: block size ENGINE_PASS_BLOCK_SIZE, prefix caching on, a pool of
    `num_blocks`, the model's whole context."""
    from simkv.config.scenario import load_scenario
    return load_scenario({
        "name": name, "model": model.name, "gpu": gpu, "seed": seed,
        "cache": {"block_size": ENGINE_PASS_BLOCK_SIZE, "num_gpu_blocks_override": num_blocks,
                  "enable_prefix_caching": True},
        "scheduler": {"max_num_seqs": max_num_seqs,
                      "max_num_batched_tokens": PROFILE_ENGINE_BATCHED_TOKENS},
        "workload": {"synthetic": {"num_requests": 1, "prompt_tokens": 8, "output_tokens": 2}}})


def _pass_engine(model, dev, seed: int, name: str, gpu: str, max_num_seqs: int,
                 num_blocks: int | None = None):
    """The real engine as the passes run it (`pass_scenario`), on a pool of `num_blocks`
    (default: `pass_num_blocks` of the free device memory)."""
    from simkv.gpu.engine import Engine
    if num_blocks is None:
        import torch
        free, _ = torch.cuda.mem_get_info(dev)
        num_blocks = pass_num_blocks(model, free)
    return Engine(pass_scenario(model, seed, name, gpu, max_num_seqs, num_blocks), str(dev))


def _release(dev) -> None:
    gc.collect()            # the executor's graphs hold reference cycles
    if dev.type == "cuda":
        import torch
        torch.cuda.empty_cache()


def _step_rows(engine, start: bool = False) -> list:
    """Per step: sequences, tokens, preemptions, duration, the executor's span (exec_s), the
    host input preparation inside it (with `start`: and the step's start, prep_s) and the time
    outside it."""
    steps = engine.recorder.steps_frame()
    exec_s = np.asarray(engine.exec_s, dtype=np.float64)
    gpu_s = np.asarray(engine.gpu_s, dtype=np.float64)
    rows = []
    for k, r in enumerate(steps.itertuples(index=False)):
        row = {"step": int(r.step), "num_seqs": int(engine.num_seqs[k]),
               "num_prefill_tokens": int(r.num_prefill_tokens),
               "num_decode_tokens": int(r.num_decode_tokens),
               "preempted": int(r.preempted), "duration_s": six_digits(r.duration_s),
               "exec_s": six_digits(exec_s[k]),
               "outside_s": six_digits(r.duration_s - exec_s[k])}
        if start:
            row["start_s"] = six_digits(r.start_s)
            row["prep_s"] = six_digits(max(0.0, exec_s[k] - gpu_s[k]))
        rows.append(row)
    return rows


def measure_engine_host(model, dev, seed: int, log, num_requests: int = ENGINE_PASS_REQUESTS,
                        gpu: str = "h200", max_num_seqs: int = 256) -> tuple:
    """(rows for engine_host.csv: the engine's time per step outside the executor's span,
    the serving engine's memory ledger after the run: `MemoryLedger.report` without stages)."""
    from simkv.workload.frames import requests_from_frame
    engine = _pass_engine(model, dev, seed, "profile-engine-pass", gpu, max_num_seqs)
    t0 = time.perf_counter()
    engine.run(requests_from_frame(engine_workload(num_requests, seed)), realtime=False)
    rows = _step_rows(engine)
    ex = engine.executor
    ledger = {k: v for k, v in ex.ledger.report(ex.weight_bytes, ex.kv_pool_bytes, int(
        ex.profile.get("peak_bytes", 0))).items() if k != "stages"}
    log(f"  engine pass: {len(rows)} steps in {time.perf_counter() - t0:.0f} s; allocator slack "
        f"at the serving peak {ledger['unattributed_bytes'] / 2**30:.2f} GiB")
    del engine, ex
    _release(dev)
    return rows, ledger


def measure_serving_host(model, dev, seed: int, log, rate_rps: float,
                         num_requests: int = SERVING_REQUESTS, gpu: str = "h200",
                         max_num_seqs: int = 256, num_blocks: int | None = None) -> tuple:
    """(rows for serving_host.csv, what the pass was): the engine serving `engine_workload` by
    the wall clock at `rate_rps`; per step its start and duration, the executor's span, the
    host input preparation inside the span and the time outside it. `num_blocks`: the pool
    (default: as the offline pass sizes it on a CUDA device)."""
    from simkv.workload.frames import requests_from_frame
    engine = _pass_engine(model, dev, seed, "profile-serving-pass", gpu, max_num_seqs,
                          num_blocks)
    frame = engine_workload(num_requests, seed, rate_rps)
    t0 = time.perf_counter()
    engine.run(requests_from_frame(frame), realtime=True)
    rows = _step_rows(engine, start=True)
    info = {"rate_rps": round(float(rate_rps), 4), "requests": int(num_requests),
            "arrival_span_s": round(float(frame["arrival_s"].max()), 3), "steps": len(rows),
            "seconds": round(time.perf_counter() - t0, 1), "note": SERVING_PASS_NOTE}
    log(f"  serving pass: {len(rows)} steps at {rate_rps:.1f} requests/s in "
        f"{info['seconds']:.0f} s")
    del engine
    _release(dev)
    return rows, info


def six_digits(x: float) -> str:
    """A measured time as the profile's CSVs store it (6 significant digits)."""
    return f"{x:.6g}"
