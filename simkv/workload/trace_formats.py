"""Reading each trace format into per-request columns: Azure LLM inference CSV, Mooncake JSONL,
BurstGPT CSV and simkv's canonical CSV (INTERFACE.md, "Canonical trace CSV").

Each loader in LOADERS returns (columns, dropped, warnings) for `build_trace`. Malformed input
raises InputError naming the file, the 1-based line and what would be valid; rows a source marks
as failed or empty are dropped and counted.
"""
from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.errors import InputError, read_text
from simkv.limits import RULES

MOONCAKE_BLOCK_TOKENS = 512
# timestamp (ms), input_length, output_length: at most simkv.limits' seconds and tokens
MOONCAKE_MAXIMA = (int(RULES["trace.seconds"].high * 1000), int(RULES["trace.tokens"].high),
                   int(RULES["trace.tokens"].high))
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1

AZURE_COLUMNS = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
BURSTGPT_COLUMNS = ["Timestamp", "Request tokens", "Response tokens"]
CSV_REQUIRED = ["arrival_s", "prompt_tokens", "output_tokens"]
# request_id: the trace's own ids, which parent_request_id refers to (default: the 0-based row);
# requests are renumbered by arrival all the same
CSV_OPTIONAL = ["prefix_ids", "prefix_block_tokens", "tenant", "adapter", "n", "cancel_after_s",
                "request_id", "parent_request_id", "mm_spans"]
MM_SPANS_EXAMPLE = "'0:576:cat.png 900:576:dog.png'"
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
    if "Model" in raw.columns:     # for workload.model_filter (simkv.workload.traces)
        columns["model"] = raw["Model"].str.strip().to_numpy(dtype=object)
    return _drop_rows(columns, {"failed (Response tokens == 0)": output == 0,
                                "empty prompt (Request tokens == 0)": prompt == 0})


def _load_mooncake(path: Path):
    keys = ("timestamp", "input_length", "output_length")
    numbers, hash_ids, line_numbers = [], [], []
    text = read_text(path, "trace").replace("\r\n", "\n").replace("\r", "\n")
    for line_number, line in enumerate(text.split("\n"), 1):
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
        for key, value, most in zip(keys, values, MOONCAKE_MAXIMA):
            if type(value) is not int or not 0 <= value <= most:
                raise InputError(f"{where}: {key} must be an integer >= 0 and <= "
                                 f"{most:,}, got {_shown(value)}")
        ids = row["hash_ids"]
        if not isinstance(ids, list) or any(type(i) is not int or not INT64_MIN <= i <= INT64_MAX
                                            for i in ids):
            raise InputError(f"{where}: hash_ids must be a list of 64-bit integers")
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
                        + ", ".join(CSV_REQUIRED + CSV_OPTIONAL))
    columns = {"arrival_s": _numbers(path, lines, raw["arrival_s"], integer=False),
               "prompt_tokens": _numbers(path, lines, raw["prompt_tokens"], minimum=1),
               "output_tokens": _numbers(path, lines, raw["output_tokens"], minimum=1)}
    for name in ("tenant", "adapter"):
        if name in raw:
            columns[name] = raw[name].str.strip().to_numpy(dtype=object)
    if "n" in raw:
        n = _numbers(path, lines, raw["n"], minimum=1, maximum=RULES["n"].high, empty_ok=True)
        columns["n"] = np.where(np.isnan(n), 1, n)
    if "cancel_after_s" in raw:
        columns["cancel_after_s"] = _numbers(path, lines, raw["cancel_after_s"], integer=False,
                                             empty_ok=True)
    if "prefix_ids" in raw:
        columns.update(_prefix_columns(path, lines, raw, columns["prompt_tokens"]))
    if "mm_spans" in raw:
        columns["mm_spans"] = _mm_spans(path, lines, raw["mm_spans"], columns["prompt_tokens"])
    if "parent_request_id" in raw:
        columns["parent_request_id"] = _parent_rows(path, lines, raw, columns)
    columns = {k: v.astype(np.int64) if k in ("prompt_tokens", "output_tokens", "n") else v
               for k, v in columns.items()}
    return columns, {}, warnings


def _parent_rows(path, lines, raw, columns) -> np.ndarray:
    """parent_request_id as the 0-based row of the parent (-1: none), checked: the parent
    exists, arrives no later than the child (and is listed first when at the same time, so no
    request continues itself through a cycle), and its prompt and output fit in the child's
    prompt (the child's prompt is the parent's prompt + output + new tokens)."""
    text = raw["parent_request_id"].str.strip().tolist()
    if "request_id" in raw:            # the trace's own ids: any text, one per row
        own = "request_id"
        rows: dict = {}
        for i, rid in enumerate(raw["request_id"].str.strip().tolist()):
            if not rid:
                raise InputError(f"{path}: line {lines[i]}: request_id is empty; with "
                                 f"parent_request_id every request needs an id")
            if rows.setdefault(rid, i) != i:
                raise InputError(f"{path}: line {lines[i]}: request_id {rid!r} repeats line "
                                 f"{lines[rows[rid]]}; every request needs its own id")
    else:
        own = "0-based row (there is no request_id column)"
        rows = {str(i): i for i in range(len(raw))}
    parents = np.full(len(raw), -1, dtype=np.int64)
    for i, parent in enumerate(text):
        if parent in ("", "-1"):
            continue
        p = rows.get(parent)
        if p is None:
            raise InputError(f"{path}: line {lines[i]}: parent_request_id {parent!r} names no "
                             f"request (it refers to a {own}); leave it empty or -1 for none")
        if p == i:
            raise InputError(f"{path}: line {lines[i]}: parent_request_id {parent!r} is the "
                             f"request itself; a prompt can only continue an earlier request")
        parents[i] = p
    arrival, prompt, output = (columns[k] for k in ("arrival_s", "prompt_tokens", "output_tokens"))
    for i in np.flatnonzero(parents >= 0).tolist():
        p = int(parents[i])
        where = f"{path}: line {lines[i]}: parent_request_id {text[i]!r} (line {lines[p]})"
        if arrival[p] > arrival[i] or (arrival[p] == arrival[i] and p > i):
            cycle = _cycle_through(parents, i)
            if cycle:
                raise InputError(f"{where} closes a cycle of parents (lines "
                                 f"{' -> '.join(str(lines[r]) for r in cycle)}); each request "
                                 f"must continue an earlier one")
            later = "after" if arrival[p] > arrival[i] else "at the same time as, and below,"
            raise InputError(f"{where} arrives {later} this request ({arrival[p]:g} s against "
                             f"{arrival[i]:g} s); a parent must arrive first")
        if prompt[i] < prompt[p] + output[p]:
            raise InputError(f"{where}: prompt_tokens {int(prompt[i])} is shorter than the "
                             f"parent's prompt {int(prompt[p])} + output {int(output[p])} = "
                             f"{int(prompt[p] + output[p])}; the prompt continues the parent's")
    return parents


def _cycle_through(parents: np.ndarray, start: int) -> list:
    """The rows of the cycle of parents that `start` lies on, from `start` back to it (empty:
    none)."""
    path, row = [start], int(parents[start])
    while row >= 0 and len(path) <= len(parents):
        if row == start:
            return path + [start]
        path.append(row)
        row = int(parents[row])
    return []


def _mm_spans(path, lines, text: pd.Series, prompt) -> list:
    """Parse `offset:length:id` items (space-separated) into sorted (offset, length, id)
    tuples, None where empty; each item inside the prompt, none overlapping another."""
    spans = []
    for i, cell in enumerate(text.str.strip().tolist()):
        if not cell:
            spans.append(None)
            continue
        where = f"{path}: line {lines[i]}: mm_spans"
        items = []
        for item in cell.split():
            parts = item.split(":", 2)
            if len(parts) != 3 or not parts[2] or not all(
                    re.fullmatch(r"[0-9]{1,12}", p) for p in parts[:2]):
                raise InputError(f"{where}: item {item!r} is not offset:length:id (offset and "
                                 f"length integers >= 0, id any text), e.g. {MM_SPANS_EXAMPLE}")
            offset, length = int(parts[0]), int(parts[1])
            if length < 1 or offset + length > prompt[i]:
                raise InputError(f"{where}: item {item!r} must cover 1 or more tokens inside "
                                 f"the prompt of {int(prompt[i])} tokens (offset + length <= "
                                 f"prompt_tokens)")
            items.append((offset, length, parts[2]))
        items.sort()
        for (o1, l1, a), (o2, _, b) in zip(items, items[1:]):
            if o2 < o1 + l1:
                raise InputError(f"{where}: items {o1}:{l1}:{a} and {o2}:...:{b} overlap; "
                                 f"each placeholder token belongs to one item")
        spans.append(tuple(items))
    return spans


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
    except UnicodeDecodeError:
        read_text(path, "trace")          # raises, naming the line
        raise
    except pd.errors.ParserError as e:
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


def _numbers(path, lines, text: pd.Series, *, integer=True, minimum=0, maximum=None,
             empty_ok=False):
    """Parse a string column as numbers in [minimum, maximum] (float array; NaN where empty
    and allowed). `maximum` defaults to the bound of simkv.limits: trace.tokens' for integers
    (token counts), trace.seconds' for the rest (seconds)."""
    if maximum is None:
        maximum = RULES["trace.tokens" if integer else "trace.seconds"].high
    text = text.str.strip()
    empty = (text == "").to_numpy()
    values = pd.to_numeric(text, errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(values) | (values < minimum) | (values > maximum)
        if integer:
            bad |= values != np.floor(values)
    bad &= ~(empty & empty_ok)
    kind = "an integer" if integer else "a number"
    valid = f"{kind} >= {minimum} and <= {int(maximum):,}" + (" or empty" if empty_ok else "")
    _fail_first(path, lines, text, bad, f"{text.name} must be {valid}")
    return values


def _shown(value) -> str:
    """repr of a value, a huge integer by its digits."""
    if type(value) is int and abs(value) >= 10**20:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


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

