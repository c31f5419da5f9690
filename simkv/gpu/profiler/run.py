"""The whole profile: every part asked for, block size by block size, written as it goes."""
from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from simkv.gpu.engine_pass import (ENGINE_PASS_NOTE, ENGINE_PASS_REQUESTS, SERVING_LOAD,
                                   measure_engine_host, measure_serving_host)
from simkv.gpu.host import host_conditions, pin_to_cpu
from simkv.gpu.profiler.grid import _plan, _tokens, profile_block_size, profiling_executor
from simkv.gpu.profiler.host_noise import measure_host_noise
from simkv.gpu.profiler.ledger import measure_ledger
from simkv.gpu.profiler.meta import _meta, _nvidia_smi, gpu_short_name
from simkv.gpu.profiler.output import _write
from simkv.gpu.profiler.parts import GIB, LEDGER_BLOCK_SIZE, MAX_NUM_SEQS, PARTS
from simkv.gpu.profiler.transfers import profile_transfers
from simkv.profile.design import MAX_CACHED_TOKENS, design_for

# Compositions run before the ledger when the step grid is not measured, so that the run peak
# it records is a serving-like one.
LEDGER_WARM_IDS = ("prefill/1x8192+p0", "mixed/d200c512/1x1848+p0", "decode/b256/c512")
# The ledger's activation sweep: one prefill of each many tokens, into a cache of its own
LEDGER_TOKEN_COUNTS = (2048, 8192, 16384)


@dataclass
class _Pass:
    """What the parts of one profile share: the model, device, design and the rows so far."""

    model: object
    dev: object
    seed: int
    rng: np.random.Generator
    points: list
    reps: int
    quick: bool
    parts: tuple
    log: object
    started: float
    data: dict = field(default_factory=lambda: {
        "steps": [], "swaps": [], "copies": [], "memory": [], "ledger": None, "noise": [],
        "engine": [], "serving_ledger": None, "serving": [], "allreduce": []})
    tensor_parallel: tuple | None = None     # (rank, ranks) of a TP profile's rank
    model_factory: object = None             # its shards (simkv.gpu.tensor_parallel)
    agree: object = None                     # rank 0's decisions (profiler.tensor_parallel)

    @property
    def cuda(self) -> bool:
        return self.dev.type == "cuda"


def run_profile(model_name, block_sizes=(8, 16, 32, 64, 128), out_dir=None, quick: bool = False,
                device: str | None = None, seed: int = 0, reps: int | None = None,
                time_budget_s: float | None = None, parts=PARTS, log=print,
                pin_cpu: int | None = None, tensor_parallel: tuple | None = None) -> Path:
    """Profile `model_name` (bundled name or config path) and write the raw data; returns the dir.

    `parts`: any of "steps" (the step grid, every block size), "rested" (with "steps": each
    composition again after a rest, `rested_s`; a diagnostic), "serving" (with "engine", CUDA
    only: the engine serving by the wall clock, serving_host.csv), "transfers" (swaps and copies,
    every block size), "ledger" and "host_noise" (CUDA only, at block size 16). `quick`: the CI
    smoke test (a handful of tiny compositions; use it with the `tiny` model on CPU, float64
    and the reference attention). Default out_dir: profiles/<gpu>/<model>/. The files are
    rewritten after every block size; with `time_budget_s`, block sizes that would not finish
    in time are skipped (and left out of meta.json's `block_sizes`). meta.json is written when
    the step grid is measured, `meta-partial.json` otherwise. `pin_cpu`: run pinned to this CPU
    (simkv.gpu.host; then run the validation engine pinned too). `tensor_parallel`: (rank,
    ranks) of one rank of a TP profile, in the process group simkv.gpu.profiler.tensor_parallel
    starts: rank 0 writes profiles/<gpu>/<model>-tp<N>/ with every rank's all-reduce times.
    """
    import torch
    from simkv.parallel import profile_name
    from simkv.specs import load_model, profiles_dir

    started = time.perf_counter()
    pin_to_cpu(pin_cpu)
    model = load_model(model_name)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    run = _Pass(model, dev, seed, np.random.default_rng(seed),
                design_for(model, quick, cached_token_cap(model, dev)),
                reps or (2 if quick else 5), quick, parts, log, started)
    writes = True
    if tensor_parallel is not None:
        from simkv.gpu import tensor_parallel as tp_engine
        from simkv.gpu.profiler import tensor_parallel as tp_profile
        rank, ranks = tensor_parallel
        run.tensor_parallel, run.agree = tensor_parallel, tp_profile.agree
        run.model_factory = tp_engine.model_factory(rank, ranks)
        writes = rank == 0
        if "allreduce" in parts:
            rows = tp_profile.measure_allreduce(
                dev, tp_profile.QUICK_SIZES if quick else tp_profile.ALLREDUCE_SIZES,
                reps=5 if quick else 20)
            run.data["allreduce"] = tp_profile.gather_rows(rows)
            log(f"  all-reduce: {len(tp_profile.ALLREDUCE_SIZES if not quick else tp_profile.QUICK_SIZES)}"
                f" message sizes on {ranks} ranks")
    command = _command()
    if not ("steps" in parts or "transfers" in parts):
        block_sizes = [b for b in block_sizes if b == LEDGER_BLOCK_SIZE] or [LEDGER_BLOCK_SIZE]

    out = Path(out_dir) if out_dir is not None else None
    smi_before = _nvidia_smi() if run.cuda else {}
    # The engine pass first: the serving engine's memory (its allocator slack at the peak is what
    # sizing subtracts) is measured with the process's first executor (a later one can find
    # memory left behind by earlier ones; docs/profiling.md). Then the ledger's block size.
    if "engine" in parts and run.cuda:
        _engine_pass(run)
    block_sizes = sorted(block_sizes, key=lambda b: b != LEDGER_BLOCK_SIZE)
    done, longest = [], 0.0
    for bs in block_sizes:
        over = bool(time_budget_s and done
                    and time.perf_counter() - started + longest > time_budget_s)
        if run.agree is not None:
            over = run.agree(over)
        if over:
            log(f"  time budget of {time_budget_s:.0f} s reached: block sizes "
                f"{[b for b in block_sizes if b not in done]} not profiled")
            break
        bs_start = time.perf_counter()
        executor_info = _measure_block_size(run, bs)
        done.append(bs)
        longest = max(longest, time.perf_counter() - bs_start)
        meta = _profile_meta(run, sorted(done), executor_info, command, smi_before)
        out = out or profiles_dir() / meta["gpu"] / profile_name(
            model.name, run.tensor_parallel[1] if run.tensor_parallel else 1)
        if writes:
            _write(out, meta, run.data)   # after every block size
        log(f"  {meta['profile_seconds']:.0f} s elapsed")
    if "serving" in parts and run.data["engine"]:
        _serving_pass(run, meta)
    if run.cuda:
        meta["nvidia_smi_after"] = _nvidia_smi()
        if writes:
            _write(out, meta, run.data)
    log(f"wrote {out} ({len(run.data['steps'])} step rows, {meta['profile_seconds']} s)")
    return out


KV_ROOM_MARGIN = 12 * GIB     # activations, graphs and workspaces beside weights and the pool


def cached_token_cap(model, dev, free_bytes: int | None = None) -> int:
    """The most KV tokens a composition may hold on `dev`: MAX_CACHED_TOKENS, or on a GPU what
    its free memory (`free_bytes`, default: the device's now) holds once the bf16 weights,
    KV_ROOM_MARGIN and the cache of the ledger's largest forward (LEDGER_TOKEN_COUNTS, beside
    the pool) are taken (a 27B's 62 layers of KV take 0.5 MB a token: 600,000 tokens would not
    fit beside its weights, and the ledger's 16,384-token forward takes 8.3 GB more)."""
    if dev.type != "cuda":
        return MAX_CACHED_TOKENS
    if free_bytes is None:
        import torch
        free_bytes, _ = torch.cuda.mem_get_info(dev)
    per_token = model.kv_bytes_per_token("bf16")
    room = free_bytes - 2 * model.num_params - KV_ROOM_MARGIN \
        - max(LEDGER_TOKEN_COUNTS) * per_token
    return max(0, min(MAX_CACHED_TOKENS, room // per_token))


def _engine_pass(run: _Pass) -> None:
    import torch
    run.data["engine"], run.data["serving_ledger"] = measure_engine_host(
        run.model, run.dev, run.seed, run.log,
        gpu=gpu_short_name(torch.cuda.get_device_name(run.dev)), max_num_seqs=MAX_NUM_SEQS)


def _measure_block_size(run: _Pass, bs: int) -> dict:
    """The parts measured at block size `bs`, on a fresh profiling executor (released after);
    returns what meta.json records of that executor."""
    import torch
    max_tokens = max(sum(s + n for s, n, _ in p.items) for p in run.points)
    max_seqs = max(len(p.items) for p in run.points)
    num_blocks = -(-max_tokens // bs) + max_seqs + 16
    executor = profiling_executor(run.model, num_blocks, bs, run.dev, run.seed,
                                  run.model_factory)
    info = {"dtype": executor.dtype,
            "graph_sizes": executor.steps.decode_buckets() if executor.use_graphs else [],
            "mixed_sizes": executor.steps.mixed_buckets() if executor.use_graphs else [],
            "tile": None, "prefill_tile": None}
    if executor.attention == "triton":
        from simkv.gpu import kernels
        info["tile"] = kernels.decode_config(bs, run.model.head_dim, executor.dtype).tile
        info["prefill_tile"] = kernels.prefill_config(run.model.head_dim, executor.dtype).block_m
    data, parts = run.data, run.parts
    if "steps" in parts:
        data["steps"] += profile_block_size(executor, run.points, run.rng, run.reps, run.log,
                                            rested="rested" in parts, agree=run.agree)
    if "transfers" in parts:
        s, c = profile_transfers(executor, run.rng, run.reps, 64 * 2**20 if run.quick else GIB,
                                 run.log)
        data["swaps"] += s
        data["copies"] += c
    if run.cuda and bs == LEDGER_BLOCK_SIZE and "host_noise" in parts:
        data["noise"] = measure_host_noise(executor, run.points, run.rng, run.log)
    if run.cuda and bs == LEDGER_BLOCK_SIZE and "ledger" in parts:
        _ledger_part(run, executor)
    del executor
    if run.cuda:
        gc.collect()       # the executor's graphs hold reference cycles
        torch.cuda.synchronize(run.dev)
        torch.cuda.empty_cache()
    return info


def _ledger_part(run: _Pass, executor) -> None:
    if "steps" not in run.parts:        # the run peak should be a serving-like one
        for point in run.points:
            if point.id in LEDGER_WARM_IDS:
                executor.execute(_plan(point.items, executor.block_size,
                                       run.rng.permutation(executor.num_blocks),
                                       _tokens(executor, run.rng)))
    run.data["ledger"], run.data["memory"] = measure_ledger(
        executor, run.model, LEDGER_TOKEN_COUNTS, run.log, run.data.get("serving_ledger"))


def _profile_meta(run: _Pass, block_sizes: list, executor_info: dict, command,
                  smi_before: dict) -> dict:
    """meta.json for the block sizes measured so far."""
    model = run.model
    meta = _meta(model, run.dev, executor_info["dtype"], block_sizes, run.quick,
                 executor_info["graph_sizes"], command, smi_before)
    if run.data["engine"]:
        meta["engine_pass"] = ENGINE_PASS_NOTE
    meta.update(host_conditions=host_conditions(), parts=list(run.parts),
                decode_tile=executor_info["tile"], prefill_tile=executor_info["prefill_tile"],
                max_num_seqs=MAX_NUM_SEQS, mixed_token_sizes=list(executor_info["mixed_sizes"]),
                max_model_len=model.max_position_embeddings,
                profile_seconds=round(time.perf_counter() - run.started, 1))
    if run.tensor_parallel is not None:
        from simkv.gpu.profiler.tensor_parallel import tensor_parallel_meta
        meta.update(tensor_parallel_meta(run.dev, run.tensor_parallel[1]))
    return meta


def _serving_pass(run: _Pass, meta: dict) -> None:
    """The serving part, into run.data and meta: run last, so that its engine leaves nothing
    behind for the ledger's executor; arrivals at SERVING_LOAD of what the offline engine pass
    served per second."""
    import torch
    offline_rps = ENGINE_PASS_REQUESTS / sum(float(r["duration_s"]) for r in run.data["engine"])
    run.data["serving"], meta["serving_pass"] = measure_serving_host(
        run.model, run.dev, run.seed, run.log, SERVING_LOAD * offline_rps,
        gpu=gpu_short_name(torch.cuda.get_device_name(run.dev)), max_num_seqs=MAX_NUM_SEQS)
    meta["serving_pass"]["offline_throughput_rps"] = round(offline_rps, 3)
    meta["profile_seconds"] = round(time.perf_counter() - run.started, 1)


def _command() -> str | None:
    """The command that ran the profiler, as `simkv profile ...` (None when not from one)."""
    if not (sys.argv and sys.argv[0]):
        return None
    args = sys.argv[1:]
    if args[:1] == ["profile"]:         # `simkv profile ...` rather than `python -m ...profiler`
        args = args[1:]
    return " ".join(["simkv profile"] + args)
