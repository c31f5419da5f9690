"""Writing a profile folder: one CSV per measured part, ledger.json and meta.json."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from simkv.gpu.engine_pass import ENGINE_FIELDS, SERVING_FIELDS
from simkv.gpu.profiler.grid import STEP_FIELDS
from simkv.gpu.profiler.host_noise import NOISE_FIELDS
from simkv.gpu.profiler.ledger import MEMORY_FIELDS
from simkv.gpu.profiler.parts import PARTS
from simkv.gpu.profiler.transfers import TRANSFER_FIELDS


def _write(out: Path, meta: dict, data: dict) -> None:
    """Write what `data` holds of the parts in `meta["parts"]` under `out`; meta.json when the
    step grid is among them, meta-partial.json otherwise."""
    out.mkdir(parents=True, exist_ok=True)
    parts = meta.get("parts", PARTS)
    if "steps" in parts:
        rested = ["rested_s"] if any("rested_s" in row for row in data["steps"]) else []
        _write_csv(out / "steps.csv", data["steps"], STEP_FIELDS + rested)
    if "transfers" in parts:
        _write_csv(out / "swap.csv", data["swaps"], ["direction"] + TRANSFER_FIELDS)
        _write_csv(out / "copy.csv", data["copies"], TRANSFER_FIELDS)
    if data["ledger"] is not None:
        _write_csv(out / "memory.csv", data["memory"], MEMORY_FIELDS)
        ledger = dict(data["ledger"], measured={k: meta.get(k) for k in (
            "date", "command", "device_name", "torch", "triton", "cuda")})
        (out / "ledger.json").write_text(json.dumps(ledger, indent=1) + "\n")
    if data.get("engine"):
        _write_csv(out / "engine_host.csv", data["engine"], ENGINE_FIELDS)
    if data.get("serving"):
        _write_csv(out / "serving_host.csv", data["serving"], SERVING_FIELDS)
    if data.get("allreduce"):
        from simkv.gpu.profiler.tensor_parallel import ALLREDUCE_FIELDS
        _write_csv(out / "allreduce.csv", data["allreduce"], ALLREDUCE_FIELDS)
    if data["noise"]:
        _write_csv(out / "host_noise.csv", data["noise"], NOISE_FIELDS)
    name = "meta.json" if "steps" in parts else "meta-partial.json"
    (out / name).write_text(json.dumps(meta, indent=1) + "\n")


def _write_csv(path: Path, rows: list, fields: list) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
