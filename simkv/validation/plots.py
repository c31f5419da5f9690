"""Validation plots: measured against simulated TTFT and TPOT CDFs, and per-request e2e."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

def write_plots(measured: pd.DataFrame, simulated: pd.DataFrame, folder, name: str) -> list:
    """TTFT and TPOT CDF overlays and a per-request e2e scatter (small PNGs); returns paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    folder = Path(folder)
    paths = []
    m = measured[measured["status"] == "completed"]
    s = simulated[simulated["status"] == "completed"]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        fig, ax = plt.subplots(figsize=(4.2, 3.0), dpi=80)
        for df, who, style in ((m, "measured", "-"), (s, "simulated", "--")):
            values = np.sort(df[key].dropna().to_numpy() * 1e3)
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), style, where="post",
                        label=who, lw=1.4)
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{name}: {label}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, folder / f"{name}-{key.split('_')[0]}-cdf.png"))
    joined = m[["request_id", "e2e_s"]].merge(s[["request_id", "e2e_s"]], on="request_id",
                                             suffixes=("_measured", "_simulated"))
    fig, ax = plt.subplots(figsize=(3.6, 3.4), dpi=80)
    ax.scatter(joined.e2e_s_measured, joined.e2e_s_simulated, s=4, alpha=0.5, lw=0)
    top = float(np.nanmax(joined[["e2e_s_measured", "e2e_s_simulated"]].to_numpy(), initial=1e-3))
    ax.plot([0, top], [0, top], "k:", lw=1)
    ax.set_xlabel("measured e2e (s)")
    ax.set_ylabel("simulated e2e (s)")
    ax.set_title(f"{name}: per request", fontsize=9)
    paths.append(_save(fig, folder / f"{name}-e2e-scatter.png"))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
