"""What both halves of the validation share (simpy-free): the scenario's request window and
its fingerprint, and the measurement folder.

Trace workloads on the GPU machine: the shared traces are not there, so `prepare_window` writes
the scenario's requests (limit applied, time_scale not) as a canonical CSV into a data folder
that travels with the repo, and `load_validation_scenario(path, data_dir)` reads it instead.
`requests_fingerprint` lets the comparing half check it simulates the requests measured.

A measurement folder holds `meta.json`, `trace.csv` and one folder per run (RUNS) with the
engine's summary.json, requests.csv, steps.csv and ledger.json; `read_run` reads one back.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from simkv.engine.results import atomic_write_text

RUNS = ("saturated", "realtime")


# -- scenarios and the request window ------------------------------------------------------------

def window_name(scenario_path) -> str | None:
    """File name of the scenario's request window in a data folder (trace workloads only)."""
    raw = yaml.safe_load(Path(scenario_path).read_text()) or {}
    workload = raw.get("workload") or {}
    trace = workload.get("trace")
    if not trace:
        return None
    limit = workload.get("limit")
    return f"{Path(str(trace)).stem}-{limit if limit else 'all'}.csv"


def prepare_window(scenario_path, data_dir) -> Path | None:
    """Write the scenario's requests (limit applied, arrivals not time-scaled) as a canonical
    CSV under `data_dir`, for a machine without the trace; returns its path (None: synthetic)."""
    from simkv.config.scenario import load_scenario
    from simkv.workload.traces import write_canonical
    from simkv.workload.frames import load_requests_frame
    name = window_name(scenario_path)
    if name is None:
        return None
    scn = load_scenario(scenario_path, overrides={"workload.time_scale": 1.0})
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    return write_canonical(load_requests_frame(scn), data_dir / name)


def load_validation_scenario(scenario_path, data_dir=None):
    """The scenario; with `data_dir` holding its window (see `prepare_window`), the window
    replaces the trace file (format csv; time_scale and limit still apply)."""
    from simkv.config.scenario import load_scenario
    name = window_name(scenario_path) if data_dir is not None else None
    if name is not None and (Path(data_dir) / name).is_file():
        window = (Path(data_dir) / name).resolve()
        return load_scenario(scenario_path, overrides={"workload.trace": str(window),
                                                       "workload.format": "csv"})
    return load_scenario(scenario_path)


def requests_fingerprint(frame: pd.DataFrame, arrivals: bool = True) -> str:
    """sha256 of the requests a run serves (arrivals to the nanosecond, lengths, n, prefixes,
    cancellations); `arrivals=False` leaves the arrival times out."""
    cols = ["prompt_tokens", "output_tokens", "n", "prefix_block_tokens", "tenant", "adapter"]
    parts = [frame[cols].astype(str).agg(",".join, axis=1),
             frame["prefix_ids"].map(lambda ids: " ".join(map(str, ids))
                                     if isinstance(ids, (tuple, list)) else ""),
             frame["cancel_after_s"].map(lambda v: "" if math.isnan(v) else f"{v:.9f}")]
    if arrivals:
        parts.append(frame["arrival_s"].map(lambda v: f"{v:.9f}"))
    rows = pd.concat(parts, axis=1).astype(str).agg("|".join, axis=1)
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


# -- the measurement folder --------------------------------------------------------------------

def read_run(folder: Path) -> dict:
    """One run of a measurement folder: summary, requests, steps and ledger (empty without)."""
    return {"summary": json.loads((folder / "summary.json").read_text()),
            "requests": pd.read_csv(folder / "requests.csv"),
            "steps": pd.read_csv(folder / "steps.csv"),
            "ledger": json.loads((folder / "ledger.json").read_text())
            if (folder / "ledger.json").is_file() else {}}


def write_json(path: Path, data: dict) -> None:
    """`data` as indented JSON, written atomically and readable by all (numpy values as plain)."""
    atomic_write_text(path, json.dumps(data, indent=2, default=_plain) + "\n")
    path.chmod(0o644)          # the atomic writer's temp file is private (0600)


def _plain(value):
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return None if math.isnan(value) else float(value)
    if isinstance(value, (Path, tuple)):
        return str(value) if isinstance(value, Path) else list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
