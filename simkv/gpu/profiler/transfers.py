"""Block transfers: host<->device swaps (swap.csv) and copy-on-write block copies (copy.csv)."""
from __future__ import annotations

from simkv.gpu.engine_pass import six_digits
from simkv.gpu.profiler.grid import _time
from simkv.gpu.profiler.parts import GIB

TRANSFER_FIELDS = ["block_size", "num_blocks", "bytes", "time_s", "time_p10_s", "time_p90_s",
                   "reps"]


def profile_transfers(executor, rng, reps: int, max_bytes: float, log) -> tuple:
    """Rows for swap.csv (both directions) and copy.csv on one executor."""
    from simkv.engine.plan import StepPlan
    bs = executor.block_size
    bytes_per_block = executor.kv_pool_bytes // executor.num_blocks
    counts = (1, 16) if max_bytes < GIB else (1, 4, 16, 64, 256, 1024)
    counts = [n for n in counts if n * bytes_per_block <= max_bytes] or [1]
    swap_rows, copy_rows = [], []
    for n in counts:
        dev = rng.permutation(executor.num_blocks)[:2 * n].tolist()
        out = StepPlan(step=0, now_s=0.0, swap_out=[(d, h) for h, d in enumerate(dev[:n])])
        back = StepPlan(step=0, now_s=0.0, swap_in=[(h, d) for h, d in enumerate(dev[:n])])
        copies = StepPlan(step=0, now_s=0.0, block_copies=list(zip(dev[:n], dev[n:])))
        for direction, plan in (("out", out), ("in", back)):
            row = {"direction": direction, "block_size": bs, "num_blocks": n,
                   "bytes": n * bytes_per_block}
            row.update({k: (six_digits(v) if isinstance(v, float) else v)
                        for k, v in _time(executor, plan, reps, warmup=2).items() if k != "wall_s"})
            swap_rows.append(row)
        row = {"block_size": bs, "num_blocks": n, "bytes": 2 * n * bytes_per_block}
        row.update({k: (six_digits(v) if isinstance(v, float) else v)
                    for k, v in _time(executor, copies, reps).items() if k != "wall_s"})
        copy_rows.append(row)
    log(f"  block size {bs}: swaps and copies up to {counts[-1]} blocks")
    return swap_rows, copy_rows
