"""A prompt's way through vLLM against the simulator's (CPU): its first token by the prompt's
isolation, the engine's admission in the step profile's mix phases, and the cost of stretches
of prompt steps in a decode stream.

    simkv run SCENARIO_ASYNC.yaml --set cost_model=.../step-profile/fit.json --out SIM
    python scripts/vllm_device/prompts.py SIM RUN_DIR [RUN_DIR ...]
    python scripts/vllm_device/prompts.py --mix profiles/h200/llama-3.1-8b/vllm-0.26/step-profile/raw-mix.json.gz

TTFT (ms, median) of prompts of at least 512 tokens and of shorter ones, isolated (no other
prompt of 256 tokens or more arrives within ISOLATION_S of it, in the trace) or not: the same
requests on every side. Clusters: maximal stretches of prompt steps fewer than 7 steps apart,
with six decode-only steps before and five after; a measured stretch costs the sum of the
periods from the third step before its first prompt step to the third after its last, less a
decode period (the median of the second steps before and after) for each decode-only step in
that span; a simulated one the sum of its prompt steps' periods (its steps are not shifted).
`per step` and `per 1k tokens`: the least-squares split of the clusters' costs.

--mix: for each injected request of a mix phase, its submission (the steps' clock) to the
engine core's output of its prompt step, against what the simulator's clock would give for it
(half a decode period of the step it arrives in, the step already scheduled, then its window).
"""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
from windows import periods  # noqa: E402

ISOLATION_S = 0.08


def ttft_table(sim: Path, runs: list) -> list:
    sides = {"simulated": pd.read_csv(sim / "requests.csv")}
    for run in runs:
        sides[f"vLLM {run.name}"] = pd.read_csv(run / "realtime" / "requests.csv")
    base = next(iter(sides.values())).sort_values("request_id")
    a, p = base["arrival_s"].to_numpy(), base["prompt_tokens"].to_numpy()
    others = np.arange(len(a))
    iso = np.array([not ((np.abs(a - a[i]) < ISOLATION_S) & (others != i) & (p >= 256)).any()
                    for i in range(len(a))])
    big = p >= 512
    groups = {"≥512 isolated": iso & big, "≥512 not": ~iso & big,
              "<512 isolated": iso & ~big, "<512 not": ~iso & ~big}
    lines = ["| TTFT ms | requests | " + " | ".join(sides) + " |",
             "|---" * (len(sides) + 2) + "|"]
    for label, mask in groups.items():
        cells = []
        for d in sides.values():
            t = d.sort_values("request_id")["ttft_s"].to_numpy() * 1e3
            cells.append(f"{np.nanmedian(t[mask]):.1f}")
        lines.append(f"| {label} | {int(mask.sum())} | " + " | ".join(cells) + " |")
    cells = [f"{np.nanmean(d['ttft_s'].to_numpy()) * 1e3:.1f}" for d in sides.values()]
    lines.append(f"| mean, all | {len(a)} | " + " | ".join(cells) + " |")
    return lines


def clusters(steps: pd.DataFrame, shifted: bool) -> pd.DataFrame:
    pre = steps["num_prefill_tokens"].to_numpy()
    dec = steps["num_decode_tokens"].to_numpy()
    per = steps["period"].to_numpy()
    groups: list = []
    for i in np.flatnonzero(pre > 0):
        if groups and i - groups[-1][-1] <= 6:
            groups[-1].append(i)
        else:
            groups.append([i])
    rows = []
    for g in groups:
        a, b = g[0], g[-1]
        if a < 8 or b + 8 >= len(steps):
            continue
        if (pre[a - 6:a] > 0).any() or (pre[b + 1:b + 6] > 0).any() or (dec[a - 6:b + 6] == 0).any():
            continue
        if shifted:
            d = np.median(per[[a - 6, a - 5, b + 4, b + 5]])
            span = list(range(a - 3, b + 4))
            cost = per[span].sum() - sum(1 for k in span if pre[k] == 0) * d
        else:
            cost = per[g].sum()
        rows.append((len(g), int(pre[g].sum()), cost * 1e3))
    return pd.DataFrame(rows, columns=["steps", "tokens", "cost_ms"])


def cluster_table(sim: Path, runs: list) -> list:
    sides = {"simulated": clusters(periods(sim / "steps.csv"), False)}
    for run in runs:
        sides[f"vLLM {run.name}"] = clusters(periods(run / "realtime" / "steps.csv"), True)
    lines = ["| side | stretches (of >1 step) | prompt steps | prompt tokens | cost s | "
             "per step ms | per 1k tokens ms |", "|---" * 7 + "|"]
    for label, c in sides.items():
        x = np.column_stack([c["steps"], c["tokens"] / 1000])
        per_step, per_k = np.linalg.lstsq(x, c["cost_ms"], rcond=None)[0]
        lines.append(f"| {label} | {len(c)} ({int((c['steps'] > 1).sum())}) | "
                     f"{int(c['steps'].sum())} | {int(c['tokens'].sum()):,} | "
                     f"{c['cost_ms'].sum() / 1e3:.2f} | {per_step:.2f} | {per_k:.2f} |")
    return lines


def isolated_injections(raw: dict):
    """(size, arrival s, its prompt step's output s, window s, decode period s) of every
    injected prompt of the mix phases with no other prompt step within 6 steps: its window is
    the time the decode stream lost around it (7 periods less 6 decode periods)."""
    for ph in raw["phases"]:
        if "arrivals_s" not in ph:
            continue
        st = [s for s in ph["steps"] if s["num_prefill_tokens"] + s["num_decode_tokens"] > 0]
        t = np.array([s["core_t_s"] for s in st])
        per = np.append(np.diff(t), np.nan)          # per[k]: step k + 1's period
        pre = np.array([s["num_prefill_tokens"] for s in st])
        injected = ph["requests"][int(ph["spec"][1]):]
        prompt_steps = [i for i in np.flatnonzero(pre > 0) if t[i] > ph["arrivals_s"][0]]
        for (size, _), a, i in zip(injected, ph["arrivals_s"], prompt_steps):
            if pre[i] != size or i < 8 or i + 8 >= len(st):
                continue
            if (pre[i - 6:i] > 0).any() or (pre[i + 1:i + 6] > 0).any():
                continue
            d = np.median(per[[i - 6, i - 5, i + 4, i + 5]])
            yield size, a, t[i], per[i - 4:i + 3].sum() - 6 * d, d


def mix_table(raw_path: Path) -> list:
    data = raw_path.read_bytes()
    raw = json.loads(gzip.decompress(data) if raw_path.suffix == ".gz" else data)
    rows = []
    for size, a, t_out, window, d in isolated_injections(raw):
        rows.append((size, (t_out - a) * 1e3, window * 1e3, d * 1e3))
    df = pd.DataFrame(rows, columns=["size", "latency", "window", "decode"])
    df["excess"] = df["latency"] - (1.5 * df["decode"] + df["window"])
    df["bin"] = pd.cut(df["size"], [0, 384, 512, 1024, 1536, 2048])
    g = df.groupby("bin", observed=True)
    lines = ["| prompt tokens | prompts | window ms | decode ms | submission to output ms | "
             "less 1.5 decodes and the window ms |", "|---" * 6 + "|"]
    for interval, part in g:
        lines.append(f"| {int(interval.left) + 1:,}-{int(interval.right):,} | {len(part)} | "
                     f"{part['window'].median():.1f} | {part['decode'].median():.2f} | "
                     f"{part['latency'].median():.1f} | {part['excess'].median():.1f} |")
    return lines


def main(argv: list) -> int:
    if len(argv) == 2 and argv[0] == "--mix":
        print("\n".join(mix_table(Path(argv[1]))))
        return 0
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    sim, runs = Path(argv[0]), [Path(r) for r in argv[1:]]
    print("\n".join(ttft_table(sim, runs)))
    print()
    print("\n".join(cluster_table(sim, runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
