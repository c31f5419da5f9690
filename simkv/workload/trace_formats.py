"""Reading each trace format into per-request columns: Azure LLM inference CSV, Mooncake JSONL,
BurstGPT CSV and simkv's canonical CSV (INTERFACE.md, "Canonical trace CSV").

Each loader in LOADERS returns (columns, dropped, warnings) for `build_trace`. Malformed input
raises InputError naming the file, the 1-based line and what would be valid; rows a source marks
as failed or empty are dropped and counted.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.errors import InputError

MOONCAKE_BLOCK_TOKENS = 512

AZURE_COLUMNS = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
BURSTGPT_COLUMNS = ["Timestamp", "Request tokens", "Response tokens"]
CSV_REQUIRED = ["arrival_s", "prompt_tokens", "output_tokens"]
CSV_OPTIONAL = ["prefix_ids", "prefix_block_tokens", "tenant", "adapter", "n", "cancel_after_s",
                "request_id"]  # request_id is accepted and ignored: ids are renumbered by arrival
MOONCAKE_EXAMPLE = '{"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [0, 1]}'


def _load_azure(path: Path):
    raw, lines = _read_csv(path, AZURE_COLUMNS, "an Azure")
    stamps = pd.to_datetime(raw["TIMESTAMP"].str.strip(), format="ISO8601", utc=True,
                            errors="coerce")
    _fail_first(path, lines, raw["TIMESTAMP"], stamps.isna().to_numpy(),
                "TIMESTAMP must be a date-time like 2023-11-16 18:15:46.6805900")
    nanos = (stamps - stamps.min()).to_numpy().astype("timedelta64[ns]").astype(np.int64)
    prompt = _numbers(path, lines, raw["ContextTokens"], integer=True)
    output = _numbers(path, lines, raw["GeneratedTokens"], integer=True)
    columns = {"arrival_s": nanos / 1e9, "prompt_tokens": prompt, "output_tokens": output}
    return _drop_rows(columns, {"empty prompt (ContextTokens == 0)": prompt == 0,
                                "empty output (GeneratedTokens == 0)": output == 0})


def _load_burstgpt(path: Path):
    raw, lines = _read_csv(path, BURSTGPT_COLUMNS, "a BurstGPT")
    arrival = _numbers(path, lines, raw["Timestamp"], integer=False)
    prompt = _numbers(path, lines, raw["Request tokens"], integer=True)
    output = _numbers(path, lines, raw["Response tokens"], integer=True)
    columns = {"arrival_s": arrival, "prompt_tokens": prompt, "output_tokens": output}
    return _drop_rows(columns, {"failed (Response tokens == 0)": output == 0,
                                "empty prompt (Request tokens == 0)": prompt == 0})


def _load_mooncake(path: Path):
    keys = ("timestamp", "input_length", "output_length")
    numbers, hash_ids, line_numbers = [], [], []
    with open(path, encoding="utf-8-sig") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}: line {line_number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: invalid JSON ({e.msg}); expected one object per "
                                 f"line like {MOONCAKE_EXAMPLE}") from None
            if not isinstance(row, dict) or any(k not in row for k in keys + ("hash_ids",)):
                raise InputError(f"{where}: needs keys {', '.join(keys)}, hash_ids; "
                                 f"expected a line like {MOONCAKE_EXAMPLE}")
            values = [row[k] for k in keys]
            for key, value in zip(keys, values):
                if type(value) is not int or value < 0:
                    raise InputError(f"{where}: {key} must be an integer >= 0, got {value!r}")
            ids = row["hash_ids"]
            if not isinstance(ids, list) or any(type(i) is not int for i in ids):
                raise InputError(f"{where}: hash_ids must be a list of integers")
            numbers.append(values)
            hash_ids.append(tuple(ids))
            line_numbers.append(line_number)
    if not numbers:
        raise InputError(f"{path}: no requests (only blank lines); expected JSON lines like "
                         f"{MOONCAKE_EXAMPLE}")
    timestamp_ms, prompt, output = np.array(numbers, dtype=np.int64).T
    lengths = np.fromiter(map(len, hash_ids), dtype=np.int64, count=len(hash_ids))
    expected = -(-prompt // MOONCAKE_BLOCK_TOKENS)
    bad = np.flatnonzero(lengths != expected)
    if bad.size:
        i = bad[0]
        raise InputError(f"{path}: line {line_numbers[i]}: hash_ids has {lengths[i]} ids but "
                         f"input_length {prompt[i]} needs ceil({prompt[i]}/"
                         f"{MOONCAKE_BLOCK_TOKENS}) = {expected[i]}")
    columns = {"arrival_s": timestamp_ms / 1000.0, "prompt_tokens": prompt,
               "output_tokens": output, "prefix_ids": hash_ids,
               "prefix_block_tokens": np.full(len(prompt), MOONCAKE_BLOCK_TOKENS)}
    return _drop_rows(columns, {"empty prompt (input_length == 0)": prompt == 0,
                                "empty output (output_length == 0)": output == 0})


def _load_canonical(path: Path):
    raw, lines = _read_csv(path, CSV_REQUIRED, "a canonical")
    warnings = []
    unknown = [c for c in raw.columns if c not in CSV_REQUIRED + CSV_OPTIONAL]
    if unknown:
        warnings.append(f"ignored unknown column(s) {', '.join(unknown)}; known: "
                        + ", ".join(CSV_REQUIRED + CSV_OPTIONAL[:-1]))
    columns = {"arrival_s": _numbers(path, lines, raw["arrival_s"], integer=False),
               "prompt_tokens": _numbers(path, lines, raw["prompt_tokens"], minimum=1),
               "output_tokens": _numbers(path, lines, raw["output_tokens"], minimum=1)}
    for name in ("tenant", "adapter"):
        if name in raw:
            columns[name] = raw[name].str.strip().to_numpy(dtype=object)
    if "n" in raw:
        n = _numbers(path, lines, raw["n"], minimum=1, empty_ok=True)
        columns["n"] = np.where(np.isnan(n), 1, n)
    if "cancel_after_s" in raw:
        columns["cancel_after_s"] = _numbers(path, lines, raw["cancel_after_s"], integer=False,
                                             empty_ok=True)
    if "prefix_ids" in raw:
        columns.update(_prefix_columns(path, lines, raw, columns["prompt_tokens"]))
    columns = {k: v.astype(np.int64) if k in ("prompt_tokens", "output_tokens", "n") else v
               for k, v in columns.items()}
    return columns, {}, warnings


def _prefix_columns(path, lines, raw, prompt):
    """Parse space-separated prefix ids; check their count against the prompt's blocks."""
    tokens = raw["prefix_ids"].str.split()
    counts = tokens.str.len().to_numpy()
    flat = tokens.explode().dropna()
    not_int = ~flat.str.fullmatch(r"-?\d{1,18}")
    if not_int.any():
        i = raw.index.get_loc(not_int.index[not_int.to_numpy()][0])
        raise InputError(f"{path}: line {lines[i]}: prefix_ids must be space-separated "
                         f"integers, got {raw['prefix_ids'].iloc[i]!r}")
    ids = iter(flat.astype(np.int64).tolist())
    prefix_ids = [tuple(itertools.islice(ids, c)) if c else None for c in counts]
    if "prefix_block_tokens" in raw:
        block = _numbers(path, lines, raw["prefix_block_tokens"], minimum=0, empty_ok=True)
        block = np.where(np.isnan(block), 0, block).astype(np.int64)
    else:
        block = np.zeros(len(raw), dtype=np.int64)
    has_ids = counts > 0
    no_block = has_ids & (block < 1)
    if no_block.any():
        raise InputError(f"{path}: line {lines[np.argmax(no_block)]}: prefix_ids given but "
                         f"prefix_block_tokens is missing or 0; it must be >= 1 (tokens per id)")
    expected = -(-prompt.astype(np.int64) // np.maximum(block, 1))
    wrong = has_ids & (counts != expected)
    if wrong.any():
        i = int(np.argmax(wrong))
        raise InputError(f"{path}: line {lines[i]}: prefix_ids has {counts[i]} ids but "
                         f"prompt_tokens {int(prompt[i])} at prefix_block_tokens {block[i]} "
                         f"needs ceil({int(prompt[i])}/{block[i]}) = {expected[i]}")
    return {"prefix_ids": prefix_ids, "prefix_block_tokens": block}


LOADERS = {"azure": _load_azure, "mooncake": _load_mooncake, "burstgpt": _load_burstgpt,
       "csv": _load_canonical}



def _read_csv(path: Path, required: list[str], kind: str):
    """Read a CSV as strings; return (frame without blank rows, 1-based file line per row)."""
    try:
        # header=None: a row with an extra field is an error instead of becoming the index
        raw = pd.read_csv(path, header=None, dtype=str, keep_default_na=False,
                          skip_blank_lines=False, encoding="utf-8-sig")
    except pd.errors.EmptyDataError:
        raise InputError(f"{path}: empty file; expected a header with "
                         + ", ".join(required)) from None
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        reason = str(e).strip().splitlines()[-1]
        raise InputError(f"{path}: malformed CSV ({reason}); expected {kind} trace with "
                         f"columns {', '.join(required)}") from None
    header = [name.strip() for name in raw.iloc[0]]
    raw = raw.iloc[1:].set_axis(header, axis=1)
    if len(set(header)) < len(header):
        raise InputError(f"{path}: line 1: duplicate column names in {', '.join(header)}")
    missing = [c for c in required if c not in raw.columns]
    if missing:
        raise InputError(f"{path}: line 1: missing column(s) {', '.join(missing)}; {kind} "
                         f"trace needs {', '.join(required)} (found: {', '.join(raw.columns)})")
    raw = raw[~(raw == "").all(axis=1)]
    if raw.empty:
        raise InputError(f"{path}: no requests after the header; expected rows of "
                         + ", ".join(required))
    return raw, raw.index.to_numpy() + 1  # the header is line 1 and row 0


def _numbers(path, lines, text: pd.Series, *, integer=True, minimum=0, empty_ok=False):
    """Parse a string column as numbers >= minimum (float array; NaN where empty and allowed)."""
    text = text.str.strip()
    empty = (text == "").to_numpy()
    values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(values) | (values < minimum)
        if integer:
            bad |= values != np.floor(values)
    bad &= ~(empty & empty_ok)
    kind = "an integer" if integer else "a number"
    valid = f"{kind} >= {minimum}" + (" or empty" if empty_ok else "")
    _fail_first(path, lines, text, bad, f"{text.name} must be {valid}")
    return values


def _fail_first(path, lines, text: pd.Series, bad: np.ndarray, rule: str) -> None:
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(f"{path}: line {lines[i]}: {rule}, got {text.iloc[i]!r}")


def _drop_rows(columns: dict, reasons: dict[str, np.ndarray]):
    """Drop the rows each reason marks, counted under the first reason that marks them.

    Returns a loader's (columns, dropped, warnings)."""
    dropped, keep = {}, np.ones(len(columns["arrival_s"]), dtype=bool)
    for reason, mask in reasons.items():
        if hit := int((mask & keep).sum()):
            dropped[reason] = hit
        keep &= ~mask
    kept = {name: list(itertools.compress(values, keep)) if isinstance(values, list)
            else values[keep] for name, values in columns.items()}
    return kept, dropped, []

