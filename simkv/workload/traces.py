"""Request traces as one canonical pandas DataFrame (INTERFACE.md, "Canonical trace CSV").

Every loader (Azure LLM inference CSV, Mooncake JSONL, BurstGPT CSV, simkv's canonical CSV) and
the synthetic generators produce the same frame: the columns of COLUMNS in that order, one row per
request, sorted by arrival, the first arrival at 0.0 s. Malformed input raises InputError naming
the file, the 1-based line and what would be valid; rows a source marks as failed or empty are
dropped and counted in `df.attrs["dropped"]`. Each format's loader is in
`simkv.workload.trace_formats`.
"""
from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np
import pandas as pd

from simkv.errors import InputError
from simkv.limits import MAX_N, MAX_REQUESTS, MAX_SECONDS, MAX_TOKENS
from simkv.workload.trace_formats import (AZURE_COLUMNS, BURSTGPT_COLUMNS, CSV_OPTIONAL,
                                          CSV_REQUIRED, LOADERS, MOONCAKE_BLOCK_TOKENS,
                                          MOONCAKE_EXAMPLE)

__all__ = ["AZURE_COLUMNS", "BURSTGPT_COLUMNS", "COLUMNS", "CSV_OPTIONAL", "CSV_REQUIRED",
           "FORMATS", "MOONCAKE_BLOCK_TOKENS", "MOONCAKE_EXAMPLE", "build_trace",
           "check_frame", "detect_format", "load_trace", "trace_stats", "write_canonical"]

COLUMNS = ["request_id", "arrival_s", "prompt_tokens", "output_tokens", "prefix_ids",
           "prefix_block_tokens", "tenant", "adapter", "n", "cancel_after_s",
           "parent_request_id", "mm_spans"]
FORMATS = ("azure", "mooncake", "burstgpt", "csv")


def load_trace(path: str | Path, format: str = "auto", time_scale: float = 1.0,
               limit: int | None = None, offset: int = 0,
               model_filter: list | None = None) -> pd.DataFrame:
    """Load a trace file into the canonical frame (columns COLUMNS, sorted by arrival).

    `format`: auto | azure | mooncake | burstgpt | csv. `time_scale` multiplies inter-arrival
    times (2.0 = half the request rate); `offset` skips the first N requests by arrival and
    `limit` keeps the next N (a window of the trace). Arrivals are seconds from the window's
    first request. `model_filter` (BurstGPT only) keeps the rows whose Model is one of those
    names, before the window is cut. `attrs` carries `format`, `source` (the path), `dropped`
    (reason -> rows) and `warnings` (list of str).
    """
    path = Path(path)
    if format != "auto" and format not in FORMATS:
        raise InputError(f"{path}: unknown trace format {format!r}; valid: auto, "
                         + ", ".join(FORMATS))
    fmt = detect_format(path) if format == "auto" else format
    _check_file(path)
    columns, dropped, warnings = LOADERS[fmt](path)
    models = columns.pop("model", None)
    if model_filter is not None:
        columns, dropped = _filter_models(path, fmt, columns, models, model_filter, dropped)
    return build_trace(columns, source=str(path), format=fmt, dropped=dropped,
                       warnings=warnings, time_scale=time_scale, limit=limit, offset=offset)


def _filter_models(path, fmt, columns, models, wanted, dropped):
    """Keep the rows of a BurstGPT trace whose Model is in `wanted`; count the others."""
    if fmt != "burstgpt" or models is None:
        raise InputError(f"{path}: workload.model_filter needs a BurstGPT trace with a Model "
                         f"column (this one is {fmt})")
    keep = np.isin(models, list(wanted))
    if not keep.any():
        names = ", ".join(sorted(set(models.tolist())))
        raise InputError(f"{path}: workload.model_filter {list(wanted)}: no row has such a "
                         f"Model (the trace has: {names})")
    dropped = {**dropped, f"Model not in {', '.join(wanted)}": int((~keep).sum())}
    kept = {name: [v for v, k in zip(values, keep) if k] if isinstance(values, list)
            else np.asarray(values)[keep] for name, values in columns.items()}
    return kept, dropped


def detect_format(path: str | Path) -> str:
    """Name the format of a trace file (one of FORMATS) from its extension and first line."""
    path = Path(path)
    _check_file(path)
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        first = next((line.strip() for line in f if line.strip()), "")
    if path.suffix.lower() in (".jsonl", ".json") or first.startswith("{"):
        return "mooncake"
    header = {name.strip() for name in first.split(",")}
    if header & {"ContextTokens", "GeneratedTokens", "TIMESTAMP"}:
        return "azure"
    if header & {"Request tokens", "Response tokens"}:
        return "burstgpt"
    if header & {"arrival_s", "prompt_tokens", "output_tokens"}:
        return "csv"
    raise InputError(
        f"{path}: line 1: cannot tell the trace format from the header {first[:80]!r}; expected "
        f"Azure ({', '.join(AZURE_COLUMNS)}), BurstGPT ({', '.join(BURSTGPT_COLUMNS)}), "
        f"canonical ({', '.join(CSV_REQUIRED)}) or Mooncake JSONL; or name the format")


def build_trace(columns: Mapping[str, object], *, source: str, format: str,
                dropped: dict | None = None, warnings: list | None = None,
                time_scale: float = 1.0, limit: int | None = None,
                offset: int = 0) -> pd.DataFrame:
    """Assemble the canonical frame from per-request columns (any order of arrival).

    `columns` needs `arrival_s` (s), `prompt_tokens`, `output_tokens`; the other COLUMNS default
    to no prefix ids, tenant/adapter "", n 1, never cancelled, no parent, no multimodal spans.
    `parent_request_id` gives each row's parent as its 0-based index in `columns` (-1: none);
    `mm_spans` a tuple of (offset, length, id text) per row, or None. Rows are sorted stably by
    arrival (a warning counts those out of order), shifted to start at 0.0 s, inter-arrival
    times multiplied by `time_scale`, and cut to the first `limit`; in the frame a parent is
    named by its `request_id` (its position in arrival order). The inputs are trusted: a
    parent comes before its child in arrival order (the loaders check it).
    """
    dropped = dict(dropped or {})
    warnings = list(warnings or [])
    if isinstance(time_scale, bool) or not isinstance(time_scale, (int, float)) \
            or not np.isfinite(time_scale) or time_scale <= 0:
        raise InputError(f"{source}: time_scale must be a number > 0, got {time_scale!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, np.integer))
                              or limit < 1):
        raise InputError(f"{source}: limit must be an integer >= 1 or null, got {limit!r}")
    arrival = np.asarray(columns["arrival_s"], dtype=float)
    rows = len(arrival)
    if rows == 0:
        why = f" left after dropping {dropped}" if dropped else ""
        raise InputError(f"{source}: the trace has no requests{why}; it needs at least one")

    def column(name, default, dtype):
        values = columns.get(name)
        return np.full(rows, default, dtype=dtype) if values is None else np.asarray(values, dtype)

    prefix_ids = columns.get("prefix_ids")
    mm_spans = columns.get("mm_spans")
    frame = pd.DataFrame({
        "arrival_s": arrival,
        "prompt_tokens": column("prompt_tokens", 0, np.int64),
        "output_tokens": column("output_tokens", 0, np.int64),
        "prefix_ids": pd.Series([None] * rows if prefix_ids is None else list(prefix_ids),
                                dtype=object),
        "prefix_block_tokens": column("prefix_block_tokens", 0, np.int64),
        "tenant": column("tenant", "", object),
        "adapter": column("adapter", "", object),
        "n": column("n", 1, np.int64),
        "cancel_after_s": column("cancel_after_s", np.nan, float),
        "parent_request_id": column("parent_request_id", -1, np.int64),
        "mm_spans": pd.Series([None] * rows if mm_spans is None else list(mm_spans),
                              dtype=object),
    })
    out_of_order = int((arrival < np.maximum.accumulate(arrival)).sum())
    if out_of_order:
        warnings.append(f"{out_of_order} request(s) arrived out of order; sorted by arrival")
        order = np.argsort(arrival, kind="stable")
        frame = frame.iloc[order].reset_index(drop=True)
        if columns.get("parent_request_id") is not None:   # rows -> positions in the new order
            position = np.empty(rows, dtype=np.int64)
            position[order] = np.arange(rows)
            parent = frame["parent_request_id"].to_numpy()
            frame["parent_request_id"] = np.where(parent >= 0, position[np.maximum(parent, 0)],
                                                  -1)
    if offset:
        if offset >= len(frame):
            raise InputError(f"{source}: workload.offset {offset} skips every request (the "
                             f"trace has {len(frame)})")
        if columns.get("parent_request_id") is not None and \
                (frame["parent_request_id"].to_numpy() >= 0).any():
            raise InputError(f"{source}: workload.offset cuts a trace whose turns continue "
                             "earlier requests (parent_request_id); use limit alone")
        frame = frame.iloc[offset:].reset_index(drop=True)
    if limit is not None:
        frame = frame.iloc[:limit].reset_index(drop=True)
    frame["arrival_s"] = (frame["arrival_s"] - frame["arrival_s"].iloc[0]) * float(time_scale)
    frame.loc[frame["prefix_ids"].isna(), "prefix_block_tokens"] = 0
    frame["tenant"] = frame["tenant"].astype(str)
    frame["adapter"] = frame["adapter"].astype(str)
    frame.insert(0, "request_id", np.arange(len(frame), dtype=np.int64))
    frame.attrs.update(format=format, source=source, dropped=dropped, warnings=warnings)
    check_frame(frame, source)
    return frame


def check_frame(frame: pd.DataFrame, source: str) -> None:
    """InputError unless the frame is one the simulator can finish (simkv.limits): at most
    MAX_REQUESTS requests, arrivals finite and within MAX_SECONDS, lengths within MAX_TOKENS
    and n within MAX_N (each loader checks its rows; this holds for every source, generators
    and time_scale included)."""
    if len(frame) > MAX_REQUESTS:
        raise InputError(f"{source}: {len(frame):,} requests, more than the simulator takes "
                         f"({MAX_REQUESTS:,}); keep the first ones with workload.limit")
    arrival = frame["arrival_s"].to_numpy(dtype=float)
    if len(arrival) and not (np.isfinite(arrival).all() and arrival[-1] <= MAX_SECONDS):
        raise InputError(f"{source}: arrivals span {arrival[-1]:g} s (after time_scale), more "
                         f"than the simulator takes ({MAX_SECONDS:g} s); lower "
                         f"workload.time_scale or keep fewer requests (workload.limit)")
    for name, most in (("prompt_tokens", MAX_TOKENS), ("output_tokens", MAX_TOKENS),
                       ("n", MAX_N)):
        values = frame[name].to_numpy()
        if len(values) and (values.max() > most or values.min() < 0):
            i = int(np.argmax((values > most) | (values < 0)))
            raise InputError(f"{source}: request {i}: {name} {int(values[i]):,} is not in "
                             f"[0, {most:,}]")


def trace_stats(df: pd.DataFrame) -> dict:
    """Summarise a canonical trace as a JSON-serialisable dict (plain ints, floats, None).

    Times in seconds, rates in requests/s, token figures in tokens. `prefix_repeat_fraction` is
    the fraction of prompt blocks (at the trace's `prefix_block_tokens`) whose chained id already
    appeared earlier in the trace, i.e. the ideal prefix-cache hit ratio with unbounded memory.
    """
    arrival = df["arrival_s"].to_numpy(dtype=float)
    requests = len(df)
    duration_s = float(arrival[-1] - arrival[0]) if requests else 0.0
    gaps = np.diff(arrival)
    has_ids = df["prefix_ids"].notna().to_numpy()
    ids = df["prefix_ids"][has_ids]
    repeat_fraction = None
    block_tokens = 0
    if has_ids.any():
        lengths = ids.map(len).to_numpy()
        blocks = df["prefix_block_tokens"].to_numpy()[has_ids]
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=lengths.sum())
        keys = pd.DataFrame({"block_tokens": np.repeat(blocks, lengths), "id": flat})
        repeat_fraction = float(keys.duplicated().mean())
        block_tokens = int(pd.Series(blocks).mode().iloc[0])
    parent = df["parent_request_id"] if "parent_request_id" in df else pd.Series(-1, df.index)
    mm_spans = df["mm_spans"] if "mm_spans" in df else pd.Series(None, df.index, dtype=object)
    return {
        "format": df.attrs.get("format"),
        "source": df.attrs.get("source"),
        "requests": requests,
        "duration_s": duration_s,
        "rate_rps": requests / duration_s if duration_s > 0 else None,
        "interarrival_cv": float(gaps.std() / gaps.mean()) if gaps.size and gaps.mean() > 0
        else None,
        "prompt_tokens": _distribution(df["prompt_tokens"]),
        "output_tokens": _distribution(df["output_tokens"]),
        "prefix_fraction": float(has_ids.mean()) if requests else 0.0,
        "prefix_block_tokens": block_tokens,
        "prefix_repeat_fraction": repeat_fraction,
        "n_gt1_fraction": float((df["n"] > 1).mean()) if requests else 0.0,
        "cancel_fraction": float(df["cancel_after_s"].notna().mean()) if requests else 0.0,
        "tenants": int(df["tenant"][df["tenant"] != ""].nunique()),
        "turn_fraction": float((parent >= 0).mean()) if requests else 0.0,
        "mm_fraction": float(mm_spans.notna().mean()) if requests else 0.0,
        "dropped": {str(k): int(v) for k, v in df.attrs.get("dropped", {}).items()},
        "warnings": [str(w) for w in df.attrs.get("warnings", [])],
    }


def write_canonical(df: pd.DataFrame, path: str | Path) -> Path:
    """Write a canonical frame as the canonical CSV at `path`, atomically; returns the path.

    prefix_ids are written space-separated, a never-cancelled request's cancel_after_s empty.
    Floats are written at full precision, so `load_trace` reads back an equal frame. The turn
    columns (request_id, parent_request_id; empty for none) and mm_spans (offset:length:id
    items) are written only when some request has them.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise InputError(f"{path}: output directory {path.parent} does not exist")
    columns = [c for c in COLUMNS[:COLUMNS.index("parent_request_id")] if c != "request_id"]
    turns = "parent_request_id" in df and bool((df["parent_request_id"] >= 0).any())
    spans = "mm_spans" in df and bool(df["mm_spans"].notna().any())
    out = df[columns].copy()
    out["prefix_ids"] = out["prefix_ids"].map(
        lambda ids: " ".join(map(str, ids)) if isinstance(ids, (tuple, list)) else "")
    if turns:
        out.insert(0, "request_id", df["request_id"].to_numpy())
        out["parent_request_id"] = [str(p) if p >= 0 else ""
                                    for p in df["parent_request_id"].tolist()]
    if spans:
        out["mm_spans"] = [" ".join(f"{o}:{n}:{key}" for o, n, key in items) if items else ""
                           for items in df["mm_spans"].tolist()]
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            out.to_csv(f, index=False, lineterminator="\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise InputError(f"{path}: trace file not found")
    if path.stat().st_size == 0:
        raise InputError(f"{path}: empty file; a trace needs a header (CSV) or JSON lines")


def _distribution(values: pd.Series) -> dict:
    """{mean, p50, p90, p99, max} of a column (all None when it is empty)."""
    v = values.to_numpy(dtype=float)
    if v.size == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(v.max())}
