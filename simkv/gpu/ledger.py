"""Memory ledger of the real engine, read from the CUDA caching allocator and the driver.

The engine takes snapshots at the stages of its setup (weights loaded, workspace profiled, KV
pool allocated, kernels warmed up, CUDA graphs captured) and at the end of a run. `MemoryLedger.report()` splits the
device's peak use into parts measured independently of one another:

    weights        bytes of the weight tensors
    kv_pool        bytes of the KV cache tensor (all blocks, used or not)
    graph_pool     growth of the allocator's reserved memory while CUDA graphs were captured
                   (their private pool and the static input buffers)
    workspace      peak allocated bytes above the persistent tensors during the run
                   (activations, logits); the profiling forward's peak is reported beside it
    persistent_other  allocated bytes that are none of the above (RoPE table, staging buffers)
    non_torch      device memory used outside PyTorch's allocator (CUDA context, cuBLAS and
                   Triton modules): driver-reported use minus the allocator's reserved bytes

and compares their sum with the measured peak (non_torch + the allocator's peak reserved bytes).
The difference is memory the allocator reserved but no tensor used at the peak (caching slack);
the ledger reconciles when it is within `tolerance_bytes`. Peak use + free at the peak = the
device total, by the driver's count.
"""
from __future__ import annotations

import torch

MIB = 1 << 20
GIB = 1 << 30
# The allocator rounds segments (2 MiB small pool, 20 MiB large pool) and caches freed blocks, so
# the parts miss the peak by its slack; we accept up to 1% of the device or 512 MiB, whichever
# is larger.
TOLERANCE_FRACTION = 0.01
TOLERANCE_MIN_BYTES = 512 * MIB


class MemoryLedger:
    """Snapshots of the allocator and the driver at named stages (CUDA only)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stages: dict = {}
        free, total = torch.cuda.mem_get_info(self.device)
        self.total_bytes = int(total)
        self.parts: dict = {}
        self.snapshot("start")

    def snapshot(self, name: str) -> dict:
        """Synchronise and record allocated/reserved/peak bytes and the driver's free bytes."""
        torch.cuda.synchronize(self.device)
        stats = torch.cuda.memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        snap = {
            "allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
            "peak_allocated_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
            "peak_reserved_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
            "free_bytes": int(free),
            "used_bytes": int(total - free),
        }
        self.stages[name] = snap
        return snap

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def report(self, weights_bytes: int, kv_pool_bytes: int, profile_workspace_bytes: int = 0,
               extra: dict | None = None) -> dict:
        """The ledger as a JSON-ready dict (bytes); takes the 'end' snapshot first.

        `profile_workspace_bytes` is the peak of the profiling forward above the tensors that
        existed before it; the run's own peak is read from the allocator (the engine resets the
        peak counters after setup).
        """
        end = self.snapshot("end")
        st = self.stages
        setup = st.get("graphs") or st.get("kv_pool") or end
        before_graphs = st.get("warmup") or st.get("kv_pool") or setup
        graph_pool = max(0, setup["reserved_bytes"] - before_graphs["reserved_bytes"]) \
            if "graphs" in st else 0
        graph_allocated = max(0, setup["allocated_bytes"] - before_graphs["allocated_bytes"]) \
            if "graphs" in st else 0
        persistent = setup["allocated_bytes"]
        run_workspace = max(0, end["peak_allocated_bytes"] - persistent)
        persistent_other = max(0, persistent - weights_bytes - kv_pool_bytes - graph_allocated)
        non_torch = end["used_bytes"] - end["reserved_bytes"]
        # The engine resets the peak counters after setup: this is the run's peak, and the
        # persistent tensors (weights, KV pool, graphs) are part of it.
        peak_used = non_torch + end["peak_reserved_bytes"]
        parts = {
            "weights_bytes": int(weights_bytes),
            "kv_pool_bytes": int(kv_pool_bytes),
            "graph_pool_bytes": int(graph_pool),
            "workspace_peak_bytes": int(run_workspace),
            "persistent_other_bytes": int(persistent_other),
            "non_torch_bytes": int(non_torch),
        }
        attributed = sum(parts.values())
        tolerance = max(TOLERANCE_MIN_BYTES, int(TOLERANCE_FRACTION * self.total_bytes))
        residual = peak_used - attributed
        ledger = {
            "device_memory_bytes": self.total_bytes,
            "device_used_peak_bytes": int(peak_used),
            "device_free_at_peak_bytes": int(self.total_bytes - peak_used),
            **parts,
            "attributed_bytes": int(attributed),
            "unattributed_bytes": int(residual),
            "tolerance_bytes": int(tolerance),
            "reconciled": bool(abs(residual) <= tolerance),
            "profile_workspace_peak_bytes": int(profile_workspace_bytes),
            "note": ("device_used_peak = non_torch + allocator peak reserved; the parts are "
                     "measured separately and reconcile when |unattributed| <= tolerance "
                     "(max(512 MiB, 1% of the device)); used + free = device total"),
            "stages": st,
        }
        if extra:
            ledger.update(extra)
        return ledger


def cpu_ledger(weights_bytes: int, kv_pool_bytes: int, extra: dict | None = None) -> dict:
    """The ledger of a CPU run: tensor sizes only (no device allocator to read)."""
    ledger = {"device_memory_bytes": None, "weights_bytes": int(weights_bytes),
              "kv_pool_bytes": int(kv_pool_bytes), "reconciled": None,
              "note": "CPU run: tensor sizes only"}
    if extra:
        ledger.update(extra)
    return ledger
