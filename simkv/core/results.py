"""Result files of a run (summary.json, requests.csv, steps.csv), written atomically."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def atomic_write_text(path: Path, text: str) -> None:
    """Write through a temp file in the same folder and rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_csv(path: Path, df) -> None:
    atomic_write_text(path, df.to_csv(index=False, float_format="%.9g"))


def write_results(out_dir, summary: dict, requests, steps) -> Path:
    """summary.json, requests.csv and steps.csv under `out_dir`; returns the folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_csv(out / "requests.csv", requests)
    atomic_write_csv(out / "steps.csv", steps)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2, sort_keys=False) + "\n")
    return out
