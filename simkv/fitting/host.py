"""The host's time per step beside the device work: the engine pass's `engine_host` and the
serving pass's `serving_host`, each c0 + c_seq * num_seqs + c_prefill_token * prefill tokens."""
from __future__ import annotations

import numpy as np
import pandas as pd

from simkv.errors import InputError
from simkv.fitting.numerics import nnls, round_sig
from simkv.profile.format import ENGINE_PASS_BLOCK_SIZE

ENGINE_COLUMNS = ("num_seqs", "num_prefill_tokens", "outside_s")

SERVING_COLUMNS = ("num_seqs", "num_prefill_tokens", "prep_s", "outside_s")
SERVING_BLOCK_SIZE = ENGINE_PASS_BLOCK_SIZE   # the serving pass runs at it
SERVING_WARMUP_STEPS = 5      # the serving pass's first steps: a fresh engine's lazy set-up
SERVING_TRIM_QUANTILE = 0.995  # steps above it (a host stall) are left out of its host fits


def fit_engine_host(df: pd.DataFrame, column: str = "outside_s") -> dict:
    """The engine's time per step outside the executor (scheduling, finishing the step, metrics):
    c0 + c_seq * num_seqs + c_prefill_token * num_prefill_tokens, least squares (non-negative)
    over the profiler's engine pass. `column`: another per-step host time of the same form."""
    x = np.column_stack([np.ones(len(df)), df["num_seqs"].to_numpy(float),
                         df["num_prefill_tokens"].to_numpy(float)])
    t = df[column].to_numpy(float)
    c = nnls(x, t)
    err = np.abs(x @ c - t)
    return {"c0_s": round_sig(float(c[0])), "c_seq_s": round_sig(float(c[1])),
            "c_prefill_token_s": round_sig(float(c[2])), "rows": int(len(df)),
            "mean_s": round_sig(float(t.mean())),
            "median_abs_error_s": round_sig(float(np.median(err))),
            "formula": "c0 + c_seq * num_seqs + c_prefill_token * num_prefill_tokens, added "
                       "to every step"}


def fit_serving_host(serving: pd.DataFrame, steps: pd.DataFrame) -> dict:
    """The host as the serving pass measured it (serving_host.csv), in the engine pass's form:
    `outside` (the time outside the executor's span, which replaces `engine_host`) and `prep`
    (the host input preparation inside the span), each least squares over the pass's steps
    after SERVING_WARMUP_STEPS, less those above SERVING_TRIM_QUANTILE of it; and `grid_prep`,
    the same form over the step grid's `prep_s` (the preparation inside the profiled times) at
    the serving pass's block size, when steps.csv has it: a model then adds prep - grid_prep to
    every step (at any block size: the difference is measured at SERVING_BLOCK_SIZE only)."""
    rows = serving.iloc[SERVING_WARMUP_STEPS:]
    if len(rows) < 3:
        raise InputError(f"serving_host.csv: {len(serving)} steps; the serving pass needs more "
                         f"than {SERVING_WARMUP_STEPS + 2}")

    def trimmed(column):
        return rows[rows[column] <= rows[column].quantile(SERVING_TRIM_QUANTILE)]

    out = {"outside": fit_engine_host(trimmed("outside_s")),
           "prep": fit_engine_host(trimmed("prep_s"), "prep_s"),
           "rows": int(len(serving)), "warmup_steps": SERVING_WARMUP_STEPS,
           "block_size": SERVING_BLOCK_SIZE,
           "trim_quantile": SERVING_TRIM_QUANTILE}
    for key in ("outside", "prep"):
        out[key].pop("formula")
    steps = steps[steps["block_size"] == SERVING_BLOCK_SIZE]
    if len(steps) >= 3 and "prep_s" in steps.columns \
            and pd.to_numeric(steps["prep_s"], errors="coerce").notna().all():
        grid = pd.DataFrame({"num_seqs": steps["num_prefill_seqs"] + steps["num_decode_seqs"],
                             "num_prefill_tokens": steps["num_prefill_tokens"],
                             "prep_s": pd.to_numeric(steps["prep_s"])})
        out["grid_prep"] = fit_engine_host(grid, "prep_s")
        out["grid_prep"].pop("formula")
    out["formula"] = ("each c0 + c_seq * num_seqs + c_prefill_token * num_prefill_tokens; a step "
                      "is charged outside (instead of engine_host) + prep - grid_prep (without "
                      "grid_prep: outside only)")
    return out

