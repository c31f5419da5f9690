"""Where a real-time run's time goes, simulated against vLLM's runs (CPU): the median period of
decode-only steps by batch size, and the window of a prompt that arrives in a decode stream by
its prompt tokens.

    simkv run SCENARIO_ASYNC.yaml --set cost_model=.../step-profile/fit.json --out SIM
    python scripts/vllm_device/windows.py SIM/steps.csv RUN_DIR [RUN_DIR ...]

SCENARIO_ASYNC: the validation scenario as vLLM ran it (`scheduler.async_scheduling: true`).
A step's period runs from its start to the next step's. vLLM's engine core releases the steps
around a prompt late and early (the decode steps before it wait while the host admits it), so a
measured prompt's window is the sum of the periods from the third step before it to the third
after it, less six decode periods (the median of the second decodes before and after the
window); only prompts with six decode-only steps before and five after count. The simulator's
steps are not shifted: its window is the prompt step's own period.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

BATCH_BINS = [1, 9, 17, 33, 65, 129, 257]
PROMPT_BINS = [1, 129, 513, 1025, 2049, 4097, 8193]


def periods(path) -> pd.DataFrame:
    steps = pd.read_csv(path).sort_values("start_s").reset_index(drop=True)
    steps["period"] = steps["start_s"].shift(-1) - steps["start_s"]
    return steps


def decode_medians(steps: pd.DataFrame) -> pd.Series:
    """Median period (ms) of decode-only steps followed by another step with work, by batch."""
    work = (steps["num_prefill_tokens"] + steps["num_decode_tokens"]) > 0
    keep = ((steps["num_prefill_tokens"] == 0) & (steps["num_decode_tokens"] > 0)
            & work.shift(-1, fill_value=False) & steps["period"].notna())
    bins = pd.cut(steps.loc[keep, "num_decode_tokens"], BATCH_BINS, right=False)
    return (steps.loc[keep, "period"] * 1e3).groupby(bins, observed=True).agg(["count", "median"])


def windows(steps: pd.DataFrame, shifted: bool) -> pd.DataFrame:
    """One row per prompt step isolated in a decode stream: prompt tokens, decodes, window ms."""
    prefill = steps["num_prefill_tokens"].to_numpy()
    decodes = steps["num_decode_tokens"].to_numpy()
    period = steps["period"].to_numpy()
    rows = []
    for i in np.flatnonzero(prefill > 0):
        if i < 8 or i + 8 >= len(steps):
            continue
        near = list(range(i - 6, i)) + list(range(i + 1, i + 6))
        if (prefill[near] > 0).any() or (decodes[near] == 0).any():
            continue
        if shifted:
            decode = np.median(period[[i - 6, i - 5, i + 4, i + 5]])
            window = period[i - 3:i + 4].sum() - 6 * decode
        else:
            window = period[i]
        rows.append((int(prefill[i]), int(decodes[i]), window * 1e3))
    return pd.DataFrame(rows, columns=["prompt_tokens", "decodes", "window_ms"])


def by_prompt(rows: pd.DataFrame) -> pd.DataFrame:
    bins = pd.cut(rows["prompt_tokens"], PROMPT_BINS, right=False)
    return rows.groupby(bins, observed=True)["window_ms"].agg(["count", "median"])


def label(interval) -> str:
    return f"{int(interval.left):,}-{int(interval.right) - 1:,}"


def table(title: str, columns: dict) -> list:
    names = list(columns)
    index = sorted({i for c in columns.values() for i in c.index}, key=lambda i: i.left)
    lines = [f"| {title} | " + " | ".join(f"{n} (steps) ms" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for interval in index:
        cells = []
        for n in names:
            c = columns[n]
            cells.append(f"{c.loc[interval, 'median']:.2f} ({int(c.loc[interval, 'count'])})"
                         if interval in c.index else "–")
        lines.append(f"| {label(interval)} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    runs = {"simulated": periods(argv[0])}
    for run in argv[1:]:
        runs[f"vLLM {Path(run).name}"] = periods(Path(run) / "realtime" / "steps.csv")
    print("\n".join(table("decodes per step", {n: decode_medians(s) for n, s in runs.items()})))
    print()
    print("\n".join(table("prompt tokens", {n: by_prompt(windows(s, n != "simulated"))
                                             for n, s in runs.items()})))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
