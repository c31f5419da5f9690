"""Block copies and host<->device swaps: `time_s = c0 + c_block * blocks + c_byte * bytes`."""
from __future__ import annotations

import numpy as np
import pandas as pd

from simkv.fitting.numerics import rel_error_summary, round_sig, solve_relative

TRANSFER_COLUMNS = ("block_size", "num_blocks", "bytes", "time_s")


def fit_transfer(df: pd.DataFrame) -> dict:
    """`time_s = c0_s + c_block_s * num_blocks + c_byte_s * bytes`, non-negative, relative LSQ."""
    x = np.column_stack([np.ones(len(df)), df["num_blocks"].to_numpy(float),
                         df["bytes"].to_numpy(float)])
    t = df["time_s"].to_numpy(float)
    c = solve_relative(x, t)
    out = {"c0_s": round_sig(c[0]), "c_block_s": round_sig(c[1]), "c_byte_s": round_sig(c[2])}
    pred = x @ np.array([out["c0_s"], out["c_block_s"], out["c_byte_s"]])
    big = df["bytes"].to_numpy(float) >= np.percentile(df["bytes"], 75)
    bandwidth = np.median(df["bytes"][big] / df["time_s"][big])
    out["bandwidth_bytes_per_s"] = round_sig(float(bandwidth), 4)
    out["error"] = rel_error_summary(pred, t)
    return out

