"""Profiling a tensor-parallel replica: the profiler on every rank, and its all-reduces.

    python -m simkv.gpu.profiler --model llama-3.1-70b --tensor-parallel-size 2 [--parts ...]

starts one process per rank (simkv.gpu.tensor_parallel: NCCL on CUDA, NVLink multicast off;
gloo on CPU). Every rank runs the same profile on its shards: the step grid (the same plans in
the same order on every rank, so the collectives inside each step pair up; which steps skip
their later repetitions is rank 0's call), the transfers, and the `allreduce` part: every rank
times all-reduces of ALLREDUCE_SIZES bytes (bf16 elements; CUDA events on a GPU, the wall clock
on CPU), a warm-up then `reps` timed calls per size, each after a barrier. Rank 0's step and
transfer rows are the profile; `allreduce.csv` holds every rank's rows (message_bytes, seconds,
rank, repeat, ranks, backend), which the profiled cost model reads
(simkv.costmodel.allreduce). The folder is `profiles/<gpu>/<model>-tp<N>/`, and meta.json says
`tensor_parallel_size`, the GPU count, the backend and the link.
"""
from __future__ import annotations

import time

TP_PARTS = ("steps", "transfers", "allreduce")   # what a TP profile measures
ALLREDUCE_FIELDS = ["message_bytes", "seconds", "rank", "repeat", "ranks", "backend"]
# 4 KiB (a quarter of one 8,192-wide bf16 row) to 256 MiB (16,384 such rows), doubling
ALLREDUCE_SIZES = tuple(4096 << i for i in range(17))
QUICK_SIZES = (4096, 65536, 1 << 20)
ALLREDUCE_WARMUP = 5


def measure_allreduce(device, sizes=ALLREDUCE_SIZES, reps: int = 20, group=None) -> list:
    """This rank's all-reduce times: rows of ALLREDUCE_FIELDS, `reps` per message size."""
    import torch
    import torch.distributed as dist
    cuda = device.type == "cuda"
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    backend = dist.get_backend(group)
    rows = []
    dtype = torch.bfloat16 if cuda else torch.float32      # gloo reduces float32
    for size in sizes:
        x = torch.ones(size // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
        for repeat in range(-ALLREDUCE_WARMUP, reps):
            dist.barrier(group=group)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                dist.all_reduce(x, group=group)
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                dist.all_reduce(x, group=group)
                seconds = time.perf_counter() - t0
            if repeat >= 0:
                rows.append({"message_bytes": x.numel() * x.element_size(),
                             "seconds": round(seconds, 9), "rank": rank, "repeat": repeat,
                             "ranks": ranks, "backend": backend})
    return rows


def gather_rows(rows: list) -> list:
    """Every rank's rows on rank 0 (others get [])."""
    import torch.distributed as dist
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rows, everyone, dst=0)
    return [r for part in everyone for r in part] if everyone is not None else []


def agree(values):
    """Rank 0's `values` on every rank (a decision that timing made must be the same on all)."""
    import torch.distributed as dist
    box = [values]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def tensor_parallel_meta(device, tp: int) -> dict:
    """What meta.json records of the ranks: their count, backend, the GPUs and the link."""
    import torch
    import torch.distributed as dist
    meta = {"tensor_parallel_size": tp, "backend": dist.get_backend()}
    if device.type == "cuda":
        meta.update(gpu_count=torch.cuda.device_count(), link=_link_summary())
    else:
        meta.update(gpu_count=0, link="CPU processes (gloo over loopback)")
    return meta


def _link_summary() -> str:
    """`nvidia-smi topo -m`'s GPU0-GPU1 entry (NV18: 18 NVLinks), or what failed."""
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                             timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    import re
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in out.splitlines()]
    rows = [line.split() for line in lines if line.split()[:1] == ["GPU0"]]
    header = next((cells for cells in rows if cells[1:2] != ["X"]), None)   # the column names
    for cells in rows:
        if cells[1:2] == ["X"]:                                             # GPU0's own row
            if header is None or "GPU1" not in header:
                return "one GPU (nvidia-smi topo -m lists no GPU1)"
            return f"GPU0-GPU1 {cells[header.index('GPU1') + 1]} (nvidia-smi topo -m)"
    return "unknown (nvidia-smi topo -m gave no GPU0 row)"


def _rank_profile(rank: int, world_size: int, device: str, job: dict):
    from simkv.gpu.profiler.run import run_profile
    return str(run_profile(job["model"], job["block_sizes"], job["out_dir"], job["quick"],
                           device, reps=job["reps"], time_budget_s=job["time_budget_s"],
                           parts=job["parts"], log=print if rank == 0 else _quiet,
                           tensor_parallel=(rank, world_size)))


def _quiet(*args, **kwargs) -> None:
    return None


def run_tp_profile(model_name, tensor_parallel_size: int, block_sizes=(8, 16, 32, 64, 128),
                   out_dir=None, quick: bool = False, device: str | None = None,
                   reps: int | None = None, time_budget_s: float | None = None,
                   parts=TP_PARTS) -> str:
    """Profile `model_name` on `tensor_parallel_size` ranks; returns the folder rank 0 wrote."""
    import torch
    from simkv.errors import InputError
    from simkv.gpu.tensor_parallel import launch
    unknown = [p for p in parts if p not in TP_PARTS]
    if unknown:
        raise InputError(f"--parts: {', '.join(unknown)} not measured at tensor_parallel_size "
                         f"> 1 (a TP profile measures {', '.join(TP_PARTS)})")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.device_count() < tensor_parallel_size:
        raise InputError(f"--tensor-parallel-size {tensor_parallel_size}: this machine has "
                         f"{torch.cuda.device_count()} CUDA GPUs")
    job = {"run": _rank_profile, "device": device, "model": model_name,
           "block_sizes": tuple(block_sizes), "out_dir": out_dir, "quick": quick,
           "reps": reps, "time_budget_s": time_budget_s, "parts": tuple(parts)}
    return launch(tensor_parallel_size, job)
