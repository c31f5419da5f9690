"""The scenario's requests: a canonical trace frame (trace file or synthetic generator) and the
Request objects the scheduler serves, the same for the simulator and the real engine."""
from __future__ import annotations

import pandas as pd

from simkv.engine.request import Request, stable_key

def load_requests_frame(scenario) -> pd.DataFrame:
    """The scenario's requests as a canonical trace frame (trace file or synthetic generator),
    with `workload.time_scale` and `workload.limit` applied."""
    wl = scenario.workload
    if wl.trace is not None:
        from simkv.workload.traces import load_trace
        return load_trace(wl.trace, format=wl.format, time_scale=wl.time_scale, limit=wl.limit)
    from simkv.workload.synthetic import generate_synthetic
    base_dir = scenario.base_dir or (scenario.path.parent if scenario.path else None)
    df = generate_synthetic(wl.synthetic or {}, scenario.seed, base_dir=base_dir)
    if wl.limit is not None:
        df = df.iloc[:wl.limit].copy()
    if wl.time_scale != 1.0:
        df["arrival_s"] = df["arrival_s"] * wl.time_scale
    return df


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
