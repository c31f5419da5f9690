"""The scenario's requests: a canonical trace frame (trace file or synthetic generator) and the
Request objects the scheduler serves, the same for the simulator and the real engine."""
from __future__ import annotations

import pandas as pd

from simkv.engine.request import Request

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
    """Canonical trace frame -> Request objects (arrival order), for the simulator and the engine."""
    out = []
    cols = [df[c].tolist() for c in ("request_id", "arrival_s", "prompt_tokens", "output_tokens",
                                     "n", "prefix_ids", "prefix_block_tokens", "tenant",
                                     "adapter", "cancel_after_s")]
    for rid, arr, p, o, n, pid, pbt, tenant, adapter, cancel in zip(*cols):
        out.append(Request(int(rid), float(arr), int(p), int(o), n=int(n),
                           prefix_ids=pid if isinstance(pid, tuple) else None,
                           prefix_block_tokens=int(pbt), tenant=tenant or "",
                           adapter=adapter or "", cancel_after_s=float(cancel)))
    return out
