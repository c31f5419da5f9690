"""Where a run's numbers come from: summary.json's `provenance`, and run.json's record of the run.

`provenance` holds only what decides the results (the version, model, GPU, the scenario after
overrides, the trace and its SHA-256, the seed, the cost model and its caveats), so the same
input gives the same bytes; when and where it ran, and the command line, go to run.json. Output
options (`--out`, `--json`, `--exact`, `--export`, `--step-terms`) are not settings: they are
not part of the scenario and change no figure.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from simkv._version import __version__
from simkv.config.scenario import scenario_to_dict

ROOFLINE_CAVEAT = ("roofline estimate from specs, not a measurement: its figures are not "
                   "comparable one for one with a profiled GPU's (compare GPUs on one cost-model "
                   "kind: --set cost_model=roofline for all of them)")


def settings(scenario) -> dict:
    """The scenario after overrides as plain data (model and GPU by name), without its path."""
    out = scenario_to_dict(scenario)
    out.pop("path", None)
    return out


def provenance(scenario, cost_models) -> dict:
    """summary.json's `provenance` for a run of `scenario` timed by `cost_models` (one model, or
    one per replica of a fleet)."""
    models = cost_models if isinstance(cost_models, (list, tuple)) else [cost_models]
    trace = scenario.workload.trace
    records = _unique(cost_model_record(m) for m in models)
    return {
        "simkv_version": __version__,
        "model": scenario.model.name,
        "gpu": scenario.gpu.name,
        "settings": settings(scenario),
        "trace": str(trace) if trace is not None else None,
        "trace_sha256": file_sha256(trace) if trace is not None else None,
        "seed": scenario.seed,
        "cost_model": records[0] if len(records) == 1 else records,
        "caveats": _unique(caveats(models) + scenario_caveats(scenario)),
    }


SWAP_CAVEAT = ("cache.preemption_mode swap: vLLM's v1 engine only recomputes (it frees a "
               "preempted request's blocks and prefills it again); swapping to host memory is "
               "a what-if of the older v0 engine")


def scenario_caveats(scenario) -> list[str]:
    """Settings a vLLM user should know simkv answers as a what-if."""
    pools = [p.scenario for p in scenario.cluster.pools] if scenario.cluster else [scenario]
    return [SWAP_CAVEAT] if any(p.cache.preemption_mode == "swap" for p in pools) else []


def cost_model_record(model) -> dict:
    """{name, kind: profile | roofline, estimate, source}: the fit file, or the roofline's note."""
    estimate = bool(getattr(model, "is_estimate", False))
    if estimate:
        source = getattr(model, "note", "roofline estimate from specs")
    else:
        source = _shown_path(getattr(model, "path", None))
    return {"name": model.name, "kind": "roofline" if estimate else "profile",
            "estimate": estimate, "source": source}


def caveats(models) -> list[str]:
    """What the cost models did not measure, in words: a profile's notes (block sizes
    interpolated between the profiled ones, an fp8 KV cache charged as half the bf16 KV reads),
    a roofline estimate, and pools timed by different kinds of cost model."""
    out = []
    for model in models:
        out += list(getattr(model, "notes", None) or [])
        if getattr(model, "is_estimate", False):
            out.append(ROOFLINE_CAVEAT)
            if getattr(model, "note", None):
                out.append(model.note)
    kinds = {cost_model_record(m)["kind"]: m.name for m in models}
    if len(kinds) > 1:
        out.append("replicas are timed by different kinds of cost model ("
                   + ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))
                   + "): differences between them mix hardware with the model's error")
    return _unique(out)


def settings_key(summary_provenance: dict) -> str:
    """A short hash of the settings and the trace's bytes: the default results folder's suffix,
    so that runs of different settings never share a folder."""
    keyed = {"settings": summary_provenance["settings"],
             "trace_sha256": summary_provenance["trace_sha256"]}
    text = json.dumps(keyed, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def run_record(wall_time_s: float | None = None) -> dict:
    """run.json: when, where and how the run was made (none of it is in summary.json)."""
    return {
        "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "command": _command(),
        "cwd": os.getcwd(),
        "python": platform.python_version(),
        "simkv_version": __version__,
        "wall_time_s": wall_time_s,
    }


def _command() -> list[str]:
    """sys.argv, with `simkv` for the program when it is simkv's CLI however it was started."""
    if not sys.argv:
        return []
    program = Path(sys.argv[0])
    if program.name in ("simkv", "cli.py") or program.parent.name == "cli":
        return ["simkv", *sys.argv[1:]]
    return list(sys.argv)


def file_sha256(path) -> str | None:
    """The SHA-256 of a file's bytes (None when it is not a file); cached by size and mtime."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return None
    return _sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _shown_path(path) -> str | None:
    """A profile's path relative to the repository when it lies inside it, else as it is."""
    if path is None:
        return None
    path = Path(path).resolve()
    root = Path(__file__).resolve().parents[2]
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _unique(items) -> list:
    out = []
    for item in items:
        if item not in out:
            out.append(item)
    return out
