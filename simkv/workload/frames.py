"""The scenario's requests: a canonical trace frame (trace file or synthetic generator) and the
Request objects the scheduler serves, the same for the simulator and the real engine."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simkv.engine.request import Request, stable_key
from simkv.errors import InputError


def load_requests_frame(scenario) -> pd.DataFrame:
    """The scenario's requests as a canonical trace frame (trace file or synthetic generator),
    with the workload's window (`offset`, `limit`, a BurstGPT `model_filter`), `time_scale`,
    length scales and `resample` applied (shape_frame)."""
    wl = scenario.workload
    if wl.trace is not None:
        from simkv.workload.traces import load_trace
        df = load_trace(wl.trace, format=wl.format, time_scale=wl.time_scale, limit=wl.limit,
                        offset=getattr(wl, "offset", 0),
                        model_filter=getattr(wl, "model_filter", None))
        return shape_frame(df, wl, scenario.seed, str(wl.trace))
    from simkv.workload.synthetic import generate_synthetic
    base_dir = scenario.base_dir or (scenario.path.parent if scenario.path else None)
    try:
        df = generate_synthetic(wl.synthetic or {}, scenario.seed, base_dir=base_dir)
    except InputError as e:            # name the scenario file the generator's keys are in
        where = getattr(scenario, "path", None)
        raise InputError(f"{where}: {e}" if where else str(e)) from None
    offset = getattr(wl, "offset", 0)
    if offset:
        if offset >= len(df):
            raise InputError(f"workload.offset {offset} skips every generated request "
                             f"({len(df)})")
        df = df.iloc[offset:].reset_index(drop=True)
        df["arrival_s"] = df["arrival_s"] - df["arrival_s"].iloc[0]
        df["request_id"] = np.arange(len(df), dtype=np.int64)
    if wl.limit is not None:
        df = df.iloc[:wl.limit].copy()
    if wl.time_scale != 1.0:
        df["arrival_s"] = df["arrival_s"] * wl.time_scale
    return shape_frame(df, wl, scenario.seed, "workload.synthetic")


def shape_frame(df: pd.DataFrame, wl, seed: int, source: str) -> pd.DataFrame:
    """The workload's length scales (`prompt_scale`, `output_scale`: lengths times the scale,
    rounded, at least 1) and `resample: bootstrap` (block_bootstrap drawn with `seed`: the one
    place a scenario's seed changes a trace replay). The frame as it is when none is set."""
    prompt_scale = getattr(wl, "prompt_scale", 1.0)
    output_scale = getattr(wl, "output_scale", 1.0)
    if prompt_scale != 1.0:
        shaped = [c for c in ("prefix_ids", "mm_spans") if c in df and df[c].notna().any()]
        if "parent_request_id" in df and (df["parent_request_id"] >= 0).any():
            shaped.append("parent_request_id")
        if shaped:
            raise InputError(f"{source}: workload.prompt_scale would break the prompts' "
                             f"{', '.join(shaped)} (they fix each prompt's blocks); scale a "
                             "trace without them")
        df = df.assign(prompt_tokens=_scaled(df["prompt_tokens"], prompt_scale))
    if output_scale != 1.0:
        df = df.assign(output_tokens=_scaled(df["output_tokens"], output_scale))
    if getattr(wl, "resample", None) == "bootstrap":
        df = block_bootstrap(df, np.random.default_rng(seed))
    if wl.time_scale != 1.0 or prompt_scale != 1.0 or output_scale != 1.0:
        from simkv.workload.traces import check_frame     # what every frame keeps, scaled too
        check_frame(df, df.attrs.get("source", source))
    return df


def _scaled(values: pd.Series, scale: float) -> np.ndarray:
    return np.maximum(1, np.rint(values.to_numpy(dtype=np.float64) * scale)).astype(np.int64)


def block_bootstrap(frame: pd.DataFrame, rng: np.random.Generator) -> pd.DataFrame:
    """A moving-block bootstrap of a request frame: as many requests, drawn as runs of
    ~sqrt(N) consecutive requests (each with the gap before it), so that bursts survive.

    By hand rather than scipy.stats.bootstrap, which resamples a statistic's sample, not a
    frame's rows in blocks. A trace whose turns continue earlier requests cannot be resampled
    (a turn would lose its parent)."""
    if "parent_request_id" in frame and (frame["parent_request_id"] >= 0).any():
        raise InputError(f"{frame.attrs.get('source', 'the trace')}: turns that continue "
                         "earlier requests (parent_request_id) cannot be block-bootstrapped")
    count = len(frame)
    block = max(1, int(math.sqrt(count)))
    gaps = np.diff(frame["arrival_s"].to_numpy(), prepend=frame["arrival_s"].iloc[0])
    starts = rng.integers(0, count - block + 1, size=-(-count // block))
    rows = np.concatenate([np.arange(s, s + block) for s in starts])[:count]
    out = frame.iloc[rows].reset_index(drop=True)
    picked = gaps[rows]
    picked[0] = 0.0
    out["arrival_s"] = np.cumsum(picked)
    out["request_id"] = np.arange(count, dtype=np.int64)
    out.attrs.update(frame.attrs)
    return out


def requests_from_frame(df: pd.DataFrame) -> list:
    """Canonical trace frame -> Request objects (arrival order), for the simulator and the engine.

    A request that continues an earlier one (`parent_request_id`) gets `parent`: that turn as
    the trace gives it, a copy the scheduler never serves (the served request's counts change
    as it runs: a capped output, a fanned-out request's summed output), chained to its own
    earlier turns the same way; the KV manager keys the blocks they share by it
    (simkv.engine.kv.hashing). Multimodal span ids become integer keys (`stable_key`).
    Turns are simulated only: the real engine has no tokens for a parent's output.
    """
    out = []
    cols = [df[c].tolist() for c in ("request_id", "arrival_s", "prompt_tokens", "output_tokens",
                                     "n", "prefix_ids", "prefix_block_tokens", "tenant",
                                     "adapter", "cancel_after_s")]
    rows = len(df)
    parents = df["parent_request_id"].tolist() if "parent_request_id" in df else [-1] * rows
    spans = df["mm_spans"].tolist() if "mm_spans" in df else [None] * rows
    referred = {p for p in parents if p >= 0}
    turns: dict = {}                  # request id -> the turn as a later turn's parent
    for rid, arr, p, o, n, pid, pbt, tenant, adapter, cancel, parent, mm in zip(
            *cols, parents, spans):
        req = Request(int(rid), float(arr), int(p), int(o), n=int(n),
                      prefix_ids=pid if isinstance(pid, tuple) else None,
                      prefix_block_tokens=int(pbt), tenant=tenant or "",
                      adapter=adapter or "", cancel_after_s=float(cancel))
        if mm:
            req.mm_spans = tuple((int(offset), int(length), stable_key(str(key)))
                                 for offset, length, key in mm)
        if parent >= 0:
            req.parent_request_id = int(parent)
            req.parent = turns[int(parent)]
        if req.request_id in referred:
            turns[req.request_id] = Request(
                req.request_id, req.arrival_s, req.prompt_tokens, req.output_tokens, n=req.n,
                prefix_ids=req.prefix_ids, prefix_block_tokens=req.prefix_block_tokens,
                tenant=req.tenant, adapter=req.adapter, mm_spans=req.mm_spans,
                parent_request_id=req.parent_request_id, parent=req.parent)
        out.append(req)
    return out
