"""The vLLM tables of docs/validation.md, from the comparison JSONs that compare_all.sh writes.

    python scripts/vllm_device/table.py profiles/h200/llama-3.1-8b/vllm-0.26/compare
    python scripts/vllm_device/table.py --measurements     # every run's passes
    python scripts/vllm_device/table.py --step-profile     # vLLM's own step times

Per scenario and comparison ((a) bundled: the H200 profile as is; (b) calibrated: step times
scaled to vLLM's saturated run; (c) vLLM's own step profile, without and with the request
path's delays, compare_all.sh's PATH_SET), simkv's error per metric judged on the mean of the runs:
mean(simulated) / mean(measured) - 1 over the scenario's runs (one run: that run's error),
with num_blocks against vLLM's own count (`vllm_num_gpu_blocks`, its null block included);
then vLLM's spread between its (first two) runs, |second - first| / their mean; then the
issue's aims. `--runs run3,run4` picks the runs (the driver with gc.freeze: runs 3 and 4).
Then, per scenario, the median period of vLLM's decode-only steps by batch size beside simkv's
engine serving the same requests (profiles/h200/llama-3.1-8b/validation/<name>/).
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd

METRICS = ("ttft_s.mean", "ttft_s.p90", "tpot_s.mean", "e2e_s.mean",
           "throughput_output_tokens_per_s", "preemptions", "running_peak")
HEADER = ("TTFT mean", "TTFT p90", "TPOT mean", "E2E mean", "output tok/s", "preemptions",
          "peak running")
PASSES = ("bundled", "calibrated", "vllm-profile", "vllm-profile-path")
LABEL = {"bundled": "(a) bundled profile", "calibrated": "(b) calibrated",
         "vllm-profile": "(c) vLLM's step profile",
         "vllm-profile-path": "(c) with the request path"}
# the comparisons the aims apply to
JUDGED = ("calibrated", "vllm-profile", "vllm-profile-path")
ORDER = ("azure-conv-load60-bs16", "bursty-cancel-n2-bs16", "mooncake-prefix-bs16",
         "azure-conv-load90-bs16")
ENGINE_RUNS = Path("profiles/h200/llama-3.1-8b/validation")
BATCH_BINS = [1, 9, 17, 33, 65, 129, 257]


def lookup(summary: dict, key: str):
    value = summary
    for part in key.split("."):
        value = value[part]
    return value


def relative(simulated: float, measured: float):
    if measured == 0:
        return 0.0 if simulated == 0 else None
    return simulated / measured - 1


def pct(value, bound=None) -> str:
    if value is None:
        return "–"
    text = f"{value * 100:+.1f}%".replace("-", "−")
    return text + (" ✗" if bound is not None and abs(value) > bound else "")


def read(folder: Path, runs=None) -> dict:
    """{pass: {name: [result JSON of run 1, run 2, ...]}}; with `runs` ({"run1", "run2"}), only
    the files of those runs (<name>-<run>.json)."""
    results = {p: defaultdict(list) for p in PASSES}
    for p in PASSES:
        for path in sorted((folder / p).glob("*.json")):       # none: no such comparison
            if runs is not None and path.stem.rsplit("-", 1)[-1] not in runs:
                continue
            result = json.loads(path.read_text())
            assert result["measured"]["pass"] == "realtime"
            results[p][result["name"]].append(result)
    return results


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def errors(runs: list) -> dict:
    """The scenario's errors on the mean of its runs, num_blocks against vLLM's own count."""
    out = {k: relative(mean(lookup(r["simulated"], k) for r in runs),
                       mean(lookup(r["measured"], k) for r in runs)) for k in METRICS}
    out["num_blocks"] = relative(runs[0]["sizing"]["simkv_size_num_blocks"],
                                 runs[0]["measured"]["vllm_num_gpu_blocks"])
    out["num_blocks_usable"] = relative(runs[0]["sizing"]["simkv_size_num_blocks"],
                                        runs[0]["measured"]["num_blocks"])
    return out


def spread(runs: list) -> dict:
    """vLLM's run-to-run spread per metric (None with one run)."""
    if len(runs) < 2:
        return {k: None for k in METRICS}
    out = {}
    for k in METRICS:
        a, b = (lookup(r["measured"], k) for r in runs[:2])
        out[k] = abs(b - a) / ((a + b) / 2) if a + b else 0.0
    return out


def aims(err: dict, spr: dict) -> dict:
    """The issue's aims for a calibrated comparison: TPOT and E2E within 5%, TTFT (mean and
    p90) within 10%, num_blocks within 2%; a bound below vLLM's own spread is the spread."""
    bounds = {"ttft_s.mean": 0.10, "ttft_s.p90": 0.10, "tpot_s.mean": 0.05, "e2e_s.mean": 0.05}
    out = {}
    for k, b in bounds.items():
        bound = max(b, spr[k] or 0.0)
        out[k] = {"bound": bound, "ok": err[k] is not None and abs(err[k]) <= bound}
    out["num_blocks"] = {"bound": 0.02, "ok": abs(err["num_blocks"]) <= 0.02}
    return out


def decode_periods(steps: pd.DataFrame) -> pd.Series:
    """Median period (ms) from a decode-only step's start to the next step's start, by batch
    size bin; steps followed by an idle gap (nothing running after them) are left out."""
    steps = steps.sort_values("start_s").reset_index(drop=True)
    period = steps["start_s"].shift(-1) - steps["start_s"]
    decode = (steps["num_prefill_tokens"] == 0) & (steps["num_decode_tokens"] > 0)
    busy = steps["num_running"].shift(-1).fillna(0) > 0
    keep = decode & busy & period.notna()
    bins = pd.cut(steps.loc[keep, "num_decode_tokens"], BATCH_BINS, right=False)
    return (period[keep] * 1e3).groupby(bins, observed=True).median()


def run_label(result: dict) -> str:
    """'run 3' for a comparison of profiles/.../<name>/run3."""
    return "run " + Path(result["measured_dir"]).name.removeprefix("run")


def step_table(results: dict) -> list:
    firsts = sorted({run_label(runs[0]) for runs in results["bundled"].values()})
    lines = [f"| scenario | decodes per step | steps (vLLM {' / '.join(firsts)}) | "
             "vLLM median period ms | "
             "simkv's engine median period ms | vLLM / simkv's engine |",
             "|---|---|---|---|---|---|"]
    for name in ORDER:
        runs = results["bundled"].get(name)
        engine = ENGINE_RUNS / name / "realtime" / "steps.csv"
        if not runs or not engine.is_file():
            continue
        vllm_steps = pd.read_csv(Path(runs[0]["measured_dir"]) / "realtime" / "steps.csv")
        ours = decode_periods(pd.read_csv(engine))
        theirs = decode_periods(vllm_steps)
        counts = pd.cut(vllm_steps.loc[(vllm_steps.num_prefill_tokens == 0)
                                       & (vllm_steps.num_decode_tokens > 0),
                                       "num_decode_tokens"], BATCH_BINS,
                        right=False).value_counts()
        for interval in theirs.index:
            if interval not in ours.index:
                continue
            label = f"{int(interval.left)}-{int(interval.right) - 1}"
            lines.append(f"| {name} | {label} | {counts[interval]} | {theirs[interval]:.2f} | "
                         f"{ours[interval]:.2f} | {theirs[interval] / ours[interval]:.2f} |")
    return lines


RUNS = Path("profiles/h200/llama-3.1-8b/vllm-0.26")


def measurements_table() -> list:
    """Every committed vLLM run's passes (summary.json), as docs/validation.md lists them."""
    lines = ["| scenario | run | pass | duration s | TTFT mean ms | TTFT p90 ms | TPOT ms | E2E s | "
             "output tok/s | preemptions | peak running | completed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ORDER:
        for run in sorted((RUNS / name).glob("run*")):
            for p in ("saturated", "realtime"):
                s = json.loads((run / p / "summary.json").read_text())
                lines.append(
                    f"| {name} | {run.name[3:]} | {p} | {s['sim_duration_s']:.2f} | "
                    f"{s['ttft_s']['mean'] * 1e3:.1f} | {s['ttft_s']['p90'] * 1e3:.1f} | "
                    f"{s['tpot_s']['mean'] * 1e3:.2f} | {s['e2e_s']['mean']:.3f} | "
                    f"{s['throughput_output_tokens_per_s']:.0f} | {s['preemptions']} | "
                    f"{s['running_peak']} | {s['requests_completed']}/{s['requests_total']} |")
    return lines


def step_profile_tables() -> list:
    """vLLM's own step times (step-profile/steps.csv): decode-only steps by batch and context
    (the ladders' stages, ms), a prompt injected into a decode batch (ms, its window) by the
    injection protocol on both machines, prompts arriving at random points of a decode stream
    (the mix phases), and the ladders measured again (the same engine; another machine:
    raw-repeat.json.gz, built here, not in the profile)."""
    df = pd.read_csv(RUNS / "step-profile" / "steps.csv")
    first_of = df["phase"].str.fullmatch(r"(decode-c\d+-b\d+|inject-b\d+|burst-p\d+-n\d+)")
    dec = df[(df["family"] == "decode") & df["phase"].str.startswith("decode-")
             & first_of].copy()
    dec["context"] = dec["phase"].str.extract(r"-c(\d+)-")[0].astype(int)
    batches = [1, 4, 16, 64, 128, 256]
    dec = dec[dec["num_decode_seqs"].isin(batches)]
    table = dec.pivot_table(index="context", columns="num_decode_seqs", values="time_s",
                            aggfunc="median") * 1e3
    lines = ["| prompt context | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---" * (len(batches) + 1) + "|"]
    for ctx, row in table.iterrows():
        lines.append(f"| {ctx:,} | " + " | ".join("–" if pd.isna(row.get(b)) else
                                                   f"{row[b]:.2f}" for b in batches) + " |")
    # the injection protocol (a fixed gap after the previous prompt's end, 3 repeats): round
    # 3's machine (inject-b<B>), and round 7's (inject-b<B>-r2, in the mix record)
    inj = df[df["phase"].str.match(r"inject-b\d+") & (df["timing"] == "window")].copy()
    inj["batch"] = inj["phase"].str.extract(r"-b(\d+)")[0].astype(int)
    inj["round"] = np.where(inj["phase"].str.endswith("-r2"), 7, 3)
    sizes = [16, 128, 384, 512, 1024, 2048, 4096]
    inj = inj[inj["num_prefill_tokens"].isin(sizes)]
    table = inj.pivot_table(index="num_prefill_tokens", columns=["batch", "round"],
                            values="time_s", aggfunc="median") * 1e3
    cols = sorted({b for b, _ in table.columns})
    lines += ["", "| prompt tokens | " + " | ".join(
        f"with {b} decode{'s' if b > 1 else ''}" for b in cols) + " |",
        "|---" * (len(cols) + 1) + "|"]
    for tokens, row in table.iterrows():
        cells = []
        for b in cols:
            vals = [f"{row[(b, r)]:.1f}" if (b, r) in row.index and not pd.isna(row[(b, r)])
                    else "–" for r in (3, 7)]
            cells.append(vals[0] if vals[1] == "–" else " / ".join(vals))
        lines.append(f"| {int(tokens):,} | " + " | ".join(cells) + " |")
    # prompts at random points of a decode stream (round 7's mix phases), window median
    mix = df[df["phase"].str.startswith("mix-") & (df["timing"] == "window")].copy()
    if len(mix):
        labels = [256, 512, 640, 768, 896, 1024, 1152, 1536, 2048]   # MIX_SIZES
        mix = mix[mix["num_prefill_tokens"].isin(labels)]
        mix["size"] = mix["num_prefill_tokens"].astype(int)
        table = mix.pivot_table(index="phase", columns="size", values="time_s",
                                aggfunc="median", observed=True) * 1e3
        order = sorted(table.index, key=lambda n: tuple(
            int(x) if x.isdigit() else 0 for x in
            pd.Series([n]).str.extract(r"mix-b(\d+)-c(\w+)-o(\d+)").iloc[0]))
        lines += ["", "| phase (B decodes, context, outputs) | decodes (median) | "
                  + " | ".join(f"{c:,}" for c in labels) + " |",
                  "|---" * (len(labels) + 2) + "|"]
        for name in order:
            med = int(mix.loc[mix["phase"] == name, "num_decode_seqs"].median())
            lines.append(f"| {name} | {med} | " + " | ".join(
                "–" if pd.isna(table.loc[name].get(c)) else f"{table.loc[name][c]:.1f}"
                for c in labels) + " |")
    # the same ladder again: in the same engine (-r2), on round 7's machine (-r3)
    first = df[(df["phase"] == "decode-c1024-b256") & (df["family"] == "decode")]
    first = first.set_index("num_decode_seqs")["time_s"]
    for again_name, where in (("decode-c1024-b256-r2", "in the same engine"),
                              ("decode-c1024-b256-r3", "on round 7's machine")):
        again = df[df["phase"] == again_name].set_index("num_decode_seqs")["time_s"]
        both = [b for b in first.index if b in again.index]
        if both:
            diff = [abs(again[b] / first[b] - 1) for b in both]
            lines += ["", f"decode-c1024-b256 again {where}: its {len(both)} decode batches "
                      f"({', '.join(str(int(b)) for b in both)}) {max(diff) * 100:.1f}% apart "
                      "at most"]
    repeat = RUNS / "step-profile" / "raw-repeat.json.gz"
    if repeat.exists():
        import gzip
        import json
        import tempfile

        from simkv.gpu.vllm.step_profile import build_profile
        with tempfile.TemporaryDirectory() as tmp:
            build_profile(json.loads(gzip.decompress(repeat.read_bytes())), tmp)
            other = pd.read_csv(Path(tmp) / "steps.csv")
        keys = ["phase", "step", "num_decode_seqs"]
        both = df[(df["family"] == "decode") & df["phase"].str.startswith("decode-")].merge(
            other[other["family"] == "decode"], on=keys, suffixes=("", "_repeat"))
        ratio = both["time_s_repeat"] / both["time_s"]
        lines += ["", f"round 3's phases again on round 7's machine (raw-repeat.json.gz): "
                  f"{len(both)} decode-ladder rows, repeat / profile median "
                  f"{ratio.median():.3f} (p10 {ratio.quantile(0.1):.3f}, p90 "
                  f"{ratio.quantile(0.9):.3f})"]
    return lines


def main(folder: str, runs=None) -> int:
    if folder == "--measurements":
        print("\n".join(measurements_table()))
        return 0
    if folder == "--step-profile":
        print("\n".join(step_profile_tables()))
        return 0
    results = read(Path(folder), runs)
    head = "| scenario | runs | load | comparison | scale | " + " | ".join(HEADER) + \
        " | num_blocks | all aims |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name in ORDER:
        if name not in results["bundled"]:
            continue
        spr = spread(results["bundled"][name])
        for p in PASSES:
            runs = results[p].get(name)
            if not runs:
                continue
            err = errors(runs)
            load = mean(r["load"] for r in runs)
            scale = ("1" if p != "calibrated" else
                     " / ".join(f"{r['calibration']['step_time_scale']:.3f}" for r in runs))
            check = aims(err, spr)
            cells = [pct(err[k], check[k]["bound"] if p in JUDGED and k in check
                         and load <= 0.7 else None) for k in METRICS]
            ok = ("–" if p == "bundled" else "(load > 0.7)" if load > 0.7 else
                  "**yes**" if all(c["ok"] for c in check.values()) else "no")
            print(f"| {name} | {len(runs)} | {load:.2f} | {LABEL[p]} | {scale} | "
                  + " | ".join(cells) + f" | {pct(err['num_blocks'], 0.02)} | {ok} |")
        if any(v is not None for v in spr.values()):
            first, second = (run_label(r) for r in results["bundled"][name][:2])
            print(f"| {name} | 2 | | vLLM {second} against {first} | | "
                  + " | ".join("–" if spr[k] is None else f"{spr[k] * 100:.1f}%"
                               for k in METRICS) + " | 0 | |")
    print()
    print("simkv size against vLLM's usable blocks (its count less the null block): "
          + ", ".join(f"{n} {pct(errors(results['bundled'][n])['num_blocks_usable'])}"
                      for n in ORDER if n in results["bundled"]))
    print()
    print("\n".join(step_table(results)))
    return 0


if __name__ == "__main__":
    # table.py [FOLDER | --measurements | --step-profile] [--runs run1,run2]
    args = sys.argv[1:]
    only = None
    if "--runs" in args:
        i = args.index("--runs")
        only = set(args[i + 1].split(","))
        del args[i:i + 2]
    sys.exit(main(args[0] if args else "profiles/h200/llama-3.1-8b/vllm-0.26/compare", only))
