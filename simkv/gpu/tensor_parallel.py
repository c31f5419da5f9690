"""The sample engine in tensor parallel: one process per rank, joined by torch.distributed.

Every rank holds its shards of the sample model (simkv.parallel's rules, as vLLM splits a
Llama): q/k/v and gate/up are column-parallel (the rank's heads and its share of the MLP's
features), o and down row-parallel (their partial outputs summed by an all-reduce), KV heads
split or, when there are fewer than ranks, each rank holding the one its query heads use; the
embedding table and the LM head are vocab-parallel (the vocabulary padded to a multiple of 64:
each rank looks up the ids in its rows, the all-reduce sums the rows; the logits of every rank
are gathered, so every rank samples the same greedy token). Norms are whole on every rank. The
weights are the one-GPU model's (the same seeded draws, sliced), so TP = N computes what TP = 1
does, up to the order of the floating-point sums.

Every rank runs the same engine (scheduler, KV manager, executor) on its own KV cache of its KV
heads. They stay in step because the scheduler is deterministic and every rank reads rank 0's
clock (a broadcast at each clock reading), so each sees the same arrivals at the same steps and
launches the same collectives. Rank 0's results are the run's.

`run_offline(scenario, requests, ...)` spawns the ranks (gloo on CPU, NCCL on CUDA, NVLink
multicast off) and returns rank 0's OfflineRun; `replay(...)` the same for `simkv replay`.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from simkv import parallel
from simkv.gpu.model import LlamaModel

# NVLink multicast (NVLS, symmetric memory) stays off in every rank (the device machines' rule)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


class TensorParallelLlama(LlamaModel):
    """One rank's shards of the sample model; `forward` returns the whole vocabulary's logits."""

    def __init__(self, spec, device="cpu", dtype=torch.float64, seed: int = 0,
                 attention: str = "reference", *, rank: int, world_size: int, group=None):
        problem = parallel.check(spec, world_size)
        if problem:
            raise ValueError(f"tensor_parallel_size: {problem}")
        self.rank, self.world_size, self.group = rank, world_size, group
        tp, H, KH = world_size, spec.num_heads, spec.num_kv_heads
        self.rank_heads = H // tp
        self.rank_kv_heads = parallel.kv_heads_per_rank(spec, tp)
        # the first KV head this rank holds (with replication: the one its query heads use)
        self.kv_head0 = rank * self.rank_kv_heads if KH >= tp else rank * KH // tp
        self.vocab_rows = parallel.padded_vocab_rows(spec.vocab_size, tp)
        self.vocab0 = rank * self.vocab_rows
        super().__init__(spec, device, dtype, seed, attention)
        self.num_heads, self.num_kv_heads = self.rank_heads, self.rank_kv_heads

    # -- weights: the one-GPU model's draws, sliced ------------------------------------------
    def _randn(self, seed: int, name: str, shape, std: float) -> torch.Tensor:
        return self._shard(name, super()._randn(seed, name, shape, std)).contiguous()

    def _shard(self, name: str, w: torch.Tensor) -> torch.Tensor:
        s, tp, r = self.spec, self.world_size, self.rank
        D = s.head_dim
        q = slice(r * self.rank_heads * D, (r + 1) * self.rank_heads * D)
        if name in ("embed", "lm_head"):
            rows = torch.zeros((self.vocab_rows, w.shape[1]), device=w.device, dtype=w.dtype)
            part = w[self.vocab0:self.vocab0 + self.vocab_rows]
            rows[:part.shape[0]] = part
            return rows
        if name.endswith(("qkv", "qkv_bias")):
            k0 = (s.num_heads + self.kv_head0) * D
            v0 = (s.num_heads + s.num_kv_heads + self.kv_head0) * D
            n = self.rank_kv_heads * D
            return torch.cat([w[q], w[k0:k0 + n], w[v0:v0 + n]])
        if name.endswith(".o"):
            return w[:, q]
        if name.endswith("router"):          # routing is the same on every rank
            return w
        # a dense MLP [2 I, hidden] / [hidden, I], or a MoE layer's experts [E, 2 I, hidden] /
        # [E, hidden, I]: every expert's features split
        if name.endswith("gate_up"):
            inter = w.shape[-2] // 2
            share = slice(r * inter // tp, (r + 1) * inter // tp)
            return torch.cat([w[..., share, :], w[..., inter:, :][..., share, :]], dim=-2)
        if name.endswith("down"):
            inter = w.shape[-1]
            return w[..., r * inter // tp:(r + 1) * inter // tp]
        raise AssertionError(f"no tensor-parallel rule for {name}")

    # -- the collectives ---------------------------------------------------------------------
    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab0
        mine = (local >= 0) & (local < self.vocab_rows)
        x = F.embedding(local.clamp(0, self.vocab_rows - 1), self.embed)
        return self._reduce(x * mine.unsqueeze(1).to(x.dtype))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial, group=self.group)
        return partial

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.lm_head).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=1)[:, :self.spec.vocab_size]


def model_factory(rank: int, world_size: int, group=None):
    """A GpuExecutor `model_factory` building this rank's TensorParallelLlama."""
    def build(spec, device, dtype, seed, attention):
        return TensorParallelLlama(spec, device, dtype, seed, attention, rank=rank,
                                   world_size=world_size, group=group)
    return build


def rank_0_clock(engine_cls):
    """An Engine subclass whose clock readings are rank 0's (broadcast to every rank)."""
    class RankEngine(engine_cls):
        tensor_parallel_rank = True

        def _now(self, clock0: float) -> float:
            now = torch.tensor([time.perf_counter() - clock0], dtype=torch.float64)
            dist.broadcast(now, src=0, group=clock_group())
            return float(now[0])
    return RankEngine


_CLOCK_GROUP = None


def clock_group():
    """A gloo group for the clock broadcasts (CPU tensors, whatever the ranks' backend)."""
    return _CLOCK_GROUP


# -- launching the ranks --------------------------------------------------------------------


def _rank_main(rank: int, world_size: int, backend: str, init_file: str, out_file: str,
               job) -> None:
    """One rank: join the group, build the engine on this rank's device, run `job`."""
    global _CLOCK_GROUP
    os.environ.update(MULTICAST_OFF)
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        _CLOCK_GROUP = dist.new_group(backend="gloo") if backend != "gloo" else None
        device = job.get("device") or "cpu"
        if device == "cuda":
            torch.cuda.set_device(rank)
            device = f"cuda:{rank}"
        result = job["run"](rank, world_size, device, job)
        if rank == 0:
            with open(out_file, "wb") as f:
                pickle.dump(result, f)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def launch(world_size: int, job: dict, backend: str | None = None):
    """Run `job["run"](rank, world_size, device, job)` in `world_size` spawned processes;
    returns rank 0's result. `backend`: gloo (CPU) or nccl (CUDA), default by job's device."""
    import torch.multiprocessing as mp
    backend = backend or ("nccl" if job.get("device") == "cuda" else "gloo")
    for key, value in MULTICAST_OFF.items():
        os.environ[key] = value
    with tempfile.TemporaryDirectory(prefix="simkv-tp-") as tmp:
        init_file, out_file = str(Path(tmp) / "init"), str(Path(tmp) / "rank0.pkl")
        # CUDA needs fresh processes; on CPU forked ones skip importing torch again (seconds)
        method = "spawn" if job.get("device") == "cuda" else "fork"
        mp.start_processes(_rank_main, args=(world_size, backend, init_file, out_file, job),
                           nprocs=world_size, join=True, start_method=method)
        with open(out_file, "rb") as f:
            return pickle.load(f)


def rank_engine(scenario, rank: int, world_size: int, device: str, job: dict,
                executor=None):
    """This rank's Engine (on `executor`, else a new one of the rank's shards); its clock is
    rank 0's. `job`: dtype, attention, enforce_eager, check_integrity (each optional)."""
    from simkv.gpu.engine import Engine
    if executor is None:
        executor = _rank_executor(scenario, rank, world_size, device, job)
    return rank_0_clock(Engine)(scenario, device, executor=executor,
                                check_integrity=job.get("check_integrity", False))


def _rank_executor(scenario, rank: int, world_size: int, device: str, job: dict):
    from simkv.engine.build import build_scheduler
    from simkv.gpu.engine import engine_kv_groups
    from simkv.gpu.executor import GpuExecutor
    _, sizing = build_scheduler(scenario)
    return GpuExecutor(
        scenario.model, sizing.num_blocks, scenario.cache.block_size, sizing.num_host_blocks,
        device=device, dtype=job.get("dtype"), attention=job.get("attention"),
        enforce_eager=job.get("enforce_eager", False), seed=scenario.seed,
        max_num_seqs=scenario.scheduler.max_num_seqs,
        max_model_len=scenario.scheduler.max_model_len,
        max_num_batched_tokens=scenario.scheduler.max_num_batched_tokens,
        model_factory=model_factory(rank, world_size), kv_groups=engine_kv_groups(sizing))


def _offline_job(rank: int, world_size: int, device: str, job: dict) -> dict:
    """Every arrival at 0 (simkv.gpu.engine.run_offline's run on this rank)."""
    from simkv.gpu.engine import _fresh
    engine = rank_engine(job["scenario"], rank, world_size, device, job)
    wall0 = time.perf_counter()
    duration = engine.run([_fresh(r) for r in job["requests"]], realtime=False)
    result = engine.result(duration, time.perf_counter() - wall0)
    steps = list(zip(result.steps["num_prefill_tokens"].tolist(),
                     result.steps["num_decode_tokens"].tolist()))
    return {"tokens": result.tokens, "step_tokens": steps, "summary": result.summary,
            "weight_bytes": engine.executor.weight_bytes,
            "kv_pool_bytes": engine.executor.kv_pool_bytes}


def run_offline(scenario, requests, *, device: str = "cpu", dtype=None,
                attention: str | None = None, enforce_eager: bool = False) -> dict:
    """Serve `requests` (Request objects or a canonical trace frame) with every arrival at 0 on
    `scenario.tensor_parallel_size` ranks; rank 0's {tokens, step_tokens, summary}."""
    import pandas as pd
    from simkv.workload.frames import requests_from_frame
    if isinstance(requests, pd.DataFrame):
        requests = requests_from_frame(requests)
    job = {"run": _offline_job, "scenario": scenario, "requests": list(requests),
           "device": device, "dtype": dtype, "attention": attention,
           "enforce_eager": enforce_eager}
    return launch(scenario.tensor_parallel_size, job)


def _replay_job(rank: int, world_size: int, device: str, job: dict) -> dict:
    """simkv.gpu.engine.replay's run on this rank; rank 0 writes the result files."""
    from simkv.gpu.engine import engine_info
    from simkv.workload.frames import load_requests_frame, requests_from_frame
    scenario = job["scenario"]
    wall0 = time.perf_counter()
    frame = job.get("trace_df")
    if frame is None:
        frame = load_requests_frame(scenario)
    engine = rank_engine(scenario, rank, world_size, device, job)
    duration = engine.run(requests_from_frame(frame), realtime=job["realtime"])
    result = engine.result(duration, time.perf_counter() - wall0)
    result.summary["tensor_parallel_size"] = world_size
    result.extra["engine"] = {**engine_info(engine.executor), "tensor_parallel_size": world_size,
                              "tensor_parallel_rank": rank}
    if rank == 0 and job.get("out_dir") is not None:
        result.write(job["out_dir"], save_tokens=job.get("save_tokens", False))
    return {"summary": result.summary, "tokens": result.tokens}


def replay(scenario, device: str = "cuda", out_dir=None, save_tokens: bool = False,
           realtime: bool = True, *, trace_df=None, dtype=None, attention: str | None = None,
           enforce_eager: bool = False, progress: bool = False) -> dict:
    """`simkv replay` of a tensor-parallel scenario: its ranks on as many GPUs (or CPU
    processes), rank 0's files under `out_dir`; rank 0's {summary, tokens}."""
    from simkv.errors import InputError
    tp = scenario.tensor_parallel_size
    if device == "cuda" and torch.cuda.device_count() < tp:
        raise InputError(f"tensor_parallel_size {tp}: this machine has "
                         f"{torch.cuda.device_count()} CUDA GPUs")
    job = {"run": _replay_job, "scenario": scenario, "device": device, "dtype": dtype,
           "attention": attention, "enforce_eager": enforce_eager, "realtime": realtime,
           "trace_df": trace_df, "out_dir": None if out_dir is None else str(out_dir),
           "save_tokens": save_tokens}
    return launch(tp, job)
