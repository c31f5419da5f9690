"""A profile folder's fit: read its raw CSVs and meta.json, fit the step model, the host terms
and the transfers, and write `fit.json`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.errors import InputError, read_json_object
from simkv.fitting.host import (ENGINE_COLUMNS, SERVING_COLUMNS, fit_engine_host,
                                fit_serving_host)
from simkv.fitting.numerics import round_sig
from simkv.fitting.step import fit_steps
from simkv.fitting.step_design import STEP_COLUMNS
from simkv.fitting.transfers import TRANSFER_COLUMNS, fit_transfer
from simkv.profile.format import FIT_FORMAT

FIT_FORMULA = ("G = T_lin(N_eff) + a_dec(B) * decode_context_tokens + a_long * "
               "decode_tail_tokens + a_pf * "
               "prefill_attention_pairs + a_ctx * prefill_context_tokens + a_ptail * "
               "prefill_tail_tokens + c_seq * "
               "num_seqs + c_prefill_row * N_eff * [prefill chunks] + (c_mixed + "
               "c_mixed_seq * num_decode_seqs) * [graphed mixed] + c_eager * [eager]; "
               "graphed step: t = G; eager step: "
               "t = max(G, host_floor + host_floor_per_seq * num_seqs) (host_floor "
               "0 when the chosen form has none: t = G); decode_tail_tokens: the "
               "decode programs list-scheduled in batch order; plus copies "
               "and swaps: c0 + c_block * blocks + c_byte * bytes")
RESTED_NOTE = ("median of rested_s / time_s per family (steps.csv's rested_s: each composition "
               "again after 0.1 s of idle); a diagnostic of the clock state, no model uses it")


def read_csv(path: Path, columns) -> pd.DataFrame:
    """A raw CSV with the given required columns (InputError naming the file and column)."""
    if not path.is_file():
        raise InputError(f"{path}: missing (a profile directory holds steps.csv, swap.csv, "
                         "copy.csv and meta.json from `simkv profile`)")
    try:
        df = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a readable CSV ({' '.join(str(e).split())})") from None
    for col in columns:
        if col not in df.columns:
            raise InputError(f"{path}: missing column '{col}' (needs {', '.join(columns)})")
    numeric = [c for c in columns if c not in ("id", "family", "direction")]
    bad = df[numeric].apply(pd.to_numeric, errors="coerce").isna().any()
    if bad.any():
        raise InputError(f"{path}: column '{bad[bad].index[0]}' has empty or non-numeric values")
    return df


def read_meta(profile_dir: Path) -> dict:
    """The profile's meta.json as a dict ({} when it has none)."""
    path = Path(profile_dir) / "meta.json"
    if not path.is_file():
        return {}
    return read_json_object(path, "written by `simkv profile`")


def rested_ratios(steps: pd.DataFrame) -> dict:
    """The profiler's optional `rested` part against the grid: the median of rested_s / time_s
    per family (rows without a positive, finite ratio left out, and counted)."""
    ratio = pd.to_numeric(steps["rested_s"], errors="coerce") / steps["time_s"]
    ok = np.isfinite(ratio) & (ratio > 0)
    median = {family: round_sig(float(part.median()), 4)
              for family, part in ratio[ok].groupby(steps.loc[ok, "family"])}
    return {"median_ratio": median, "rows": int(ok.sum()), "rows_left_out": int((~ok).sum()),
            "note": RESTED_NOTE}


def _fit_header(profile_dir: Path, meta: dict, steps: pd.DataFrame) -> dict:
    """fit.json's description of what was fitted: format, GPU, model, dtypes, formula, source."""
    return {"format": FIT_FORMAT,
            "gpu": meta.get("gpu", profile_dir.parent.name),
            "model": meta.get("model", profile_dir.name),
            "dtype": meta.get("dtype", "bfloat16"),
            "kv_dtype": meta.get("kv_dtype", "bf16"),
            "formula": FIT_FORMULA,
            "units": "seconds; token counts; pairs = causal query-key pairs",
            "source": {"dir": profile_dir.name, "steps_rows": int(len(steps)),
                       "profiled": meta.get("date"), "command": meta.get("command")}}


def _fit_host(profile_dir: Path, steps: pd.DataFrame) -> dict:
    """`engine_host` and `serving_host` from the profile's engine and serving passes, where
    it has them."""
    out = {}
    engine_path = profile_dir / "engine_host.csv"
    if engine_path.is_file():
        out["engine_host"] = fit_engine_host(read_csv(engine_path, ENGINE_COLUMNS))
    serving_path = profile_dir / "serving_host.csv"
    if serving_path.is_file():
        serving = read_csv(serving_path, SERVING_COLUMNS)
        try:
            out["serving_host"] = fit_serving_host(serving, steps)
        except InputError as e:
            raise InputError(f"{profile_dir}/{e}") from None
    return out


def _fit_transfers(profile_dir: Path) -> dict:
    """`swap` (per direction) and `copy` from swap.csv and copy.csv, where present."""
    out = {}
    for name in ("swap", "copy"):
        path = profile_dir / f"{name}.csv"
        if not path.is_file():
            continue
        df = read_csv(path, TRANSFER_COLUMNS + (("direction",) if name == "swap" else ()))
        if name == "swap":
            out["swap"] = {d: fit_transfer(df[df["direction"] == d])
                           for d in ("out", "in") if (df["direction"] == d).any()}
        elif len(df):
            out["copy"] = fit_transfer(df)
    return out


def fit_profile(profile_dir, out=None) -> dict:
    """Fit `profile_dir`'s raw CSVs; write `fit.json` into `out` (default: `profile_dir`).

    Returns the fit as a dict (the content of fit.json). Deterministic: refitting the same CSVs
    gives the same file (coefficients rounded to 6 significant digits, errors to 4 decimals).
    """
    profile_dir = Path(profile_dir)
    if not profile_dir.is_dir():
        raise InputError(f"{profile_dir}: not a directory (give a profile directory written by "
                         "`simkv profile`)")
    meta = read_meta(profile_dir)
    steps = read_csv(profile_dir / "steps.csv", STEP_COLUMNS)
    if steps.empty:
        raise InputError(f"{profile_dir / 'steps.csv'}: no rows")
    fit = _fit_header(profile_dir, meta, steps)
    fit.update(fit_steps(steps, meta))
    if "rested_s" in steps.columns:
        fit["rested_vs_grid"] = rested_ratios(steps)
    for key in ("model_shape", "kv_bytes_per_token"):
        if key in meta:
            fit[key] = meta[key]
    fit.update(_fit_host(profile_dir, steps))
    fit.update(_fit_transfers(profile_dir))
    out_dir = Path(out) if out is not None else profile_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fit.json").write_text(json.dumps(fit, indent=1) + "\n")
    return fit
