"""meta.json: the device, driver, versions, clocks observed, date and command of a profile."""
from __future__ import annotations

import datetime
import platform
import subprocess

import numpy as np

TIMING_NOTE = ("median of the executor's CUDA-event span of execute(plan): a warm-up round "
               "over the whole design, then interleaved timed rounds (at most 3 repetitions "
               "for steps over 50 ms); p10/p90 beside it")


def _nvidia_smi() -> dict:
    fields = "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    if not out:
        return {}
    values = [v.strip() for v in out.splitlines()[0].split(",")]
    return dict(zip(fields.split(","), values))


def gpu_short_name(device_name: str) -> str:
    """'NVIDIA H200' -> 'h200': the bundled GPU whose name appears in the device's name."""
    from simkv.specs import bundled_gpus
    text = device_name.lower().replace("-", " ")
    for name in sorted(bundled_gpus(), key=len, reverse=True):
        if name.split("-")[0] in text.split():
            return name
    return text.replace("nvidia", "").strip().split()[0] if text.strip() else "unknown"


def _meta(model, device, executor_dtype, block_sizes, quick, graph_sizes, command,
          smi_before=None) -> dict:
    import torch
    import triton
    from simkv.profile.design import model_terms
    meta = {
        "model": model.name,
        "model_shape": {k: getattr(model, k) for k in (
            "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
            "intermediate_size", "vocab_size")},
        "kv_bytes_per_token": model.kv_bytes_per_token("bf16"),
        "model_terms": model_terms(model),     # the window and expert terms' settings
        "dtype": str(executor_dtype).replace("torch.", ""),
        "kv_dtype": "bf16" if executor_dtype == torch.bfloat16 else str(executor_dtype),
        "block_sizes": list(block_sizes),
        "graph_batch_sizes": list(graph_sizes),
        "quick": quick,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "numpy": np.__version__,
        "host": platform.node(),
        "timing": TIMING_NOTE,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update({"device_name": props.name, "gpu": gpu_short_name(props.name),
                     "sm_count": props.multi_processor_count,
                     "device_memory_bytes": int(props.total_memory),
                     "cuda": torch.version.cuda, "nvidia_smi_before": smi_before or {}})
    else:
        meta.update({"device_name": platform.processor() or "cpu", "gpu": "cpu"})
    return meta
