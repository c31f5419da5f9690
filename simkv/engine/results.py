"""Result files of a run (summary.json, requests.csv, steps.csv), written atomically."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from simkv.engine.csv_columns import csv_rows, float_fields, int_fields, text_fields

_UMASK = os.umask(0o022)
os.umask(_UMASK)


def atomic_write_text(path: Path, text: str) -> None:
    """Write through a temp file in the same folder and rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_UMASK)      # mkstemp makes 0600; results are ordinary files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def csv_text(df) -> str:
    """The frame as CSV: integers as they are, floats with 9 significant digits, NaN empty.

    Written by hand because pandas' writer is the slowest part of saving a long run: a column
    at a time in numpy (simkv.engine.csv_columns; a 500,000-step steps.csv in 0.5 s, 1.1-1.5 s
    value by value, 2.3 s with pandas), value by value (`csv_text_by_value`, the same text)
    where a column holds text that is not ASCII or integers beyond 2^62."""
    header = ",".join(_text(c) for c in df.columns)
    if not len(df):
        return header + "\n"
    fields = []
    for name in df.columns:
        values = df[name]
        kind = values.dtype.kind if isinstance(values.dtype, np.dtype) else "O"   # not NA-able
        if kind in "iu" and -2 ** 62 < values.min() and values.max() < 2 ** 62:
            fields.append(int_fields(values.to_numpy()))
        elif kind == "f":
            fields.append(float_fields(values.to_numpy()))
        else:
            texts = [_text(v) for v in values.tolist()]
            if not all(map(str.isascii, texts)):
                return csv_text_by_value(df)
            fields.append(text_fields(texts))
    return header + "\n" + csv_rows(fields)


def csv_text_by_value(df) -> str:
    """`csv_text`, value by value in Python."""
    cols = []
    for name in df.columns:
        values = df[name]
        kind = values.dtype.kind
        if kind == "f":
            cols.append(["" if v != v else _FLOAT(v) for v in values.tolist()])
        elif kind in "iub":
            cols.append(_int_texts(values.tolist()))
        else:
            cols.append([_text(v) for v in values.tolist()])
    header = ",".join(_text(c) for c in df.columns)
    if not len(df):
        return header + "\n"
    return header + "\n" + "\n".join(map(",".join, zip(*cols))) + "\n"


_FLOAT = "{:.9g}".format


def _int_texts(values: list) -> list:
    """str() of each integer; a column of small repeated ones (a step's tokens, blocks, queue)
    through a table of their texts, twice as fast as str() on each."""
    if not values:
        return []
    low, high = min(values), max(values)
    if low < 0 or high > len(values) // 2 or isinstance(values[0], bool):
        return list(map(str, values))
    return list(map(list(map(str, range(high + 1))).__getitem__, values))


def _text(value) -> str:
    """A CSV field: quoted when it holds a comma, quote or newline; None/NaN empty."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    text = str(value)
    if any(c in text for c in ',"\n\r'):
        return '"' + text.replace('"', '""') + '"'
    return text


def atomic_write_csv(path: Path, df) -> None:
    atomic_write_text(path, csv_text(df))


def write_results(out_dir, summary: dict, requests, steps, run: dict | None = None) -> Path:
    """summary.json, requests.csv and steps.csv under `out_dir` (and run.json, the record of
    when and how the run was made, when `run` is given); returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_csv(out / "requests.csv", requests)
    atomic_write_csv(out / "steps.csv", steps)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, sort_keys=False) + "\n")
    if run is not None:
        atomic_write_text(out / "run.json", json.dumps(run, indent=2) + "\n")
    return out
