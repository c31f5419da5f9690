"""The memory ledger: weights, activation peak against batched tokens, CUDA-graph pool and the
rest of device memory (ledger.json, memory.csv), and how it compares with simkv.sizing's
estimate."""
from __future__ import annotations

import numpy as np

from simkv.gpu.profiler.parts import GIB, MAX_NUM_SEQS
from simkv.sizing import PROFILE_ENGINE_BATCHED_TOKENS

MEMORY_FIELDS = ["num_batched_tokens", "peak_activation_bytes"]
LEDGER_NOTE = ("activation = activation_base_bytes + activation_bytes_per_batched_token x "
               "max_num_batched_tokens (peak of a forward over that many tokens with "
               f"{MAX_NUM_SEQS} sampled rows, above the persistent tensors); other = CUDA-graph "
               "pool + memory outside PyTorch (CUDA context, cuBLAS, Triton modules) + "
               "persistent small tensors + allocator slack at the peak")


def measure_ledger(executor, model, token_counts, log, serving: dict | None = None) -> tuple:
    """(ledger dict for ledger.json, rows for memory.csv) from a block-size-16 executor.

    `serving`: the engine pass's ledger (a serving engine after its run). When given, `other`
    is made of its parts (graph pool, memory outside PyTorch, persistent tensors, allocator
    slack at the serving peak); the profiling executor's, measured after a grid of very varied
    shapes, stay beside them as `grid_other_parts` (that grid leaves more allocator slack than
    a serving engine has at its peak: docs/profiling.md)."""
    import torch
    # The engine's ledger first: its run peak is the profiling grid's, not the sweep's below.
    report = executor.ledger.report(executor.weight_bytes, executor.kv_pool_bytes,
                                    int(executor.profile.get("peak_bytes", 0)))
    points = {}
    for n in token_counts:
        prof = executor.profile_activation(n, MAX_NUM_SEQS)
        points[int(prof["tokens"])] = int(prof["peak_bytes"])
    # profile_activation reports the larger of its two forwards (n and n/2): n's peak.
    tokens = np.array(sorted(points), dtype=float)
    peaks = np.array([points[int(t)] for t in tokens], dtype=float)
    slope, base = np.polyfit(tokens, peaks, 1) if len(tokens) > 1 else (0.0, peaks[0])
    slope, base = max(0.0, float(slope)), max(0.0, float(base))
    grid_parts = _other_parts(report)
    other_parts = _other_parts(serving) if serving else grid_parts
    ledger = {
        "weights_bytes": int(executor.weight_bytes),
        "activation_bytes_per_batched_token": round(slope, 1),
        "activation_base_bytes": int(base),
        "other_bytes": int(sum(other_parts.values())),
        "other_parts": other_parts,
        "other_source": ("the engine pass: a serving engine's ledger after its run" if serving
                         else "the profiling executor after the step grid"),
        "grid_other_parts": grid_parts,
        "activation_points": [[int(t), int(p)] for t, p in zip(tokens, peaks)],
        "measured_with": {"block_size": executor.block_size, "max_num_seqs": MAX_NUM_SEQS,
                          "max_num_batched_tokens": PROFILE_ENGINE_BATCHED_TOKENS,
                          "max_model_len": executor.max_model_len,
                          "dtype": str(executor.dtype).replace("torch.", ""),
                          "kv_pool_bytes": int(executor.kv_pool_bytes),
                          "device_memory_bytes": report["device_memory_bytes"]},
        "note": LEDGER_NOTE,
        "engine_ledger": {k: v for k, v in report.items() if k != "stages"},
        "serving_ledger": serving,
    }
    ledger["estimate_comparison"] = _estimate_comparison(model, ledger)
    torch.cuda.empty_cache()
    log(f"  ledger: weights {ledger['weights_bytes'] / GIB:.2f} GiB, activation "
        f"{slope:.0f} B/token + {base / 2**20:.0f} MiB, "
        f"other {ledger['other_bytes'] / GIB:.2f} GiB")
    rows = [{"num_batched_tokens": int(t), "peak_activation_bytes": int(p)}
            for t, p in zip(tokens, peaks)]
    return ledger, rows


def _other_parts(report: dict) -> dict:
    """The parts of `other` in a MemoryLedger report, in bytes."""
    return {"cuda_graph_pool_bytes": int(report["graph_pool_bytes"]),
            "non_torch_bytes": int(report["non_torch_bytes"]),
            "persistent_other_bytes": int(report["persistent_other_bytes"]),
            "allocator_slack_bytes": int(max(0, report["unattributed_bytes"]))}


def _estimate_comparison(model, ledger: dict) -> dict:
    """Measured vs the foundation's estimate (simkv.sizing) at the default settings."""
    import simkv.sizing as sizing
    from simkv.config.scenario import SchedulerConfig
    # the settings every committed ledger compares at, the profiling executor's (vLLM 0.18's
    # defaults; a bare SchedulerConfig leaves both to the semantics, which this comparison has
    # none of)
    sched = SchedulerConfig(max_num_seqs=MAX_NUM_SEQS,
                            max_num_batched_tokens=PROFILE_ENGINE_BATCHED_TOKENS)
    estimate = {
        "weights_bytes": model.weight_bytes(sizing.WEIGHT_DTYPE_BYTES),
        "activation_bytes": sizing.estimate_activation_bytes(model, sched),
        "other_bytes": sizing.CUDA_CONTEXT_BYTES + sizing.estimate_graph_pool_bytes(model, sched)
        + sizing.ALLOCATOR_SLACK_BYTES,
    }
    measured = {
        "weights_bytes": ledger["weights_bytes"],
        "activation_bytes": int(ledger["activation_base_bytes"]
                                + ledger["activation_bytes_per_batched_token"]
                                * sched.max_num_batched_tokens),
        "other_bytes": ledger["other_bytes"],
    }
    return {"max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs, "estimate": estimate, "measured": measured,
            "measured_minus_estimate": {k: int(measured[k] - estimate[k]) for k in estimate}}
