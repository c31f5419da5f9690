"""Fit the clock model (`simkv.costmodel.clock`) to a clock probe's step traces.

    python -m simkv.costmodel.clock_fit PROBE_DIR [PROBE_DIR...] --model llama-3.1-8b \
        --profile-mhz 1635 --profile-mhz-source "..." --out profiles/h200/llama-3.1-8b/clock.json

PROBE_DIR is what `benchmarks/clock_probe.py` wrote (steps.csv, smi.csv, meta.json); probes from
different leases of the GPU are pooled, each with its own full-clock times. In order:

1. each composition's full-clock time: the faster of the first two steps of each `self` case
   (after 0.4 s idle), median over the cases;
2. its settling clock: the median nvidia-smi SM clock over a `self` case after its first 0.3 s;
   the line `settling_mhz(TFLOP/s)` (knee and slope, floored at the lowest clock seen) by least
   squares over a grid of knees;
3. the share of time that scales with the clock and the two time constants, by a grid search
   minimizing the RMS log error of every step of the `self`, `recover` and `recover_idle`
   phases replayed through `ClockState` (the simulator's own code); the `duty` phase is held
   out and reported, against a clock-blind baseline (every step at its full-clock time), as
   is every phase on its own (`by_phase`; `sustain`: 3 s of heavy work, longer than the rest).

The profile's clock (`--profile-mhz`) is what makes the fit usable with a profile: the median
SM clock over the profile's step grid, read with nvidia-smi beside it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.costmodel.clock import (CLOCK_FORMAT, ClockModel, ClockState, flop_counts,
                                   step_flops)
from simkv.errors import InputError

SENSITIVITIES = tuple(np.round(np.arange(0.10, 0.71, 0.05), 2))
TAUS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3)
HELD_OUT_PHASE = "duty"
FITTED_PHASES = ("self", "recover", "recover_idle")


def read_probe(probe_dir: Path) -> tuple:
    """(steps, smi, meta) of a clock probe; smi's `t_s` on the steps' clock."""
    probe_dir = Path(probe_dir)
    try:
        meta = json.loads((probe_dir / "meta.json").read_text())
        steps = pd.read_csv(probe_dir / "steps.csv")
        smi = pd.read_csv(probe_dir / "smi.csv", skipinitialspace=True)
    except (OSError, ValueError) as e:
        raise InputError(f"{probe_dir}: not a clock probe ({' '.join(str(e).split())})") from None
    need = {"phase", "case", "seq", "composition", "end_s", "time_s"}
    if not need <= set(steps.columns):
        raise InputError(f"{probe_dir}/steps.csv: needs columns {sorted(need)}")
    smi = smi.rename(columns=lambda c: c.split(" [")[0])
    clock_column = [c for c in smi.columns if c.startswith("clocks") and c.endswith(".sm")]
    if "timestamp" not in smi or not clock_column:
        raise InputError(f"{probe_dir}/smi.csv: needs nvidia-smi's timestamp and clocks.sm")
    stamp = pd.to_datetime(smi["timestamp"], format="%Y/%m/%d %H:%M:%S.%f")
    smi["t_s"] = (stamp - pd.Timestamp("1970-01-01")).dt.total_seconds() - meta["t0_unix"]
    smi["sm_mhz"] = pd.to_numeric(smi[clock_column[0]], errors="coerce")
    steps = steps.sort_values("end_s").reset_index(drop=True)
    steps["start_s"] = steps["end_s"] - steps["time_s"]
    return steps, smi, meta


def composition_table(steps, smi, meta, model) -> pd.DataFrame:
    """Per composition: full-clock seconds, settling clock (MHz) and TFLOP/s at full clock."""
    from simkv.gpu.profile_design import features
    from simkv.core.plan import StepPlan
    counts = flop_counts(model)
    self_steps = steps[steps["phase"] == "self"]
    rows = []
    for (name, case_start), g in self_steps.groupby(
            ["composition", (self_steps["seq"] == 0).cumsum()]):
        settled = smi[(smi["t_s"] > g["start_s"].min() + 0.3) & (smi["t_s"] < g["end_s"].max())]
        rows.append({"composition": name, "full_s": g["time_s"].iloc[:2].min(),
                     "settling_mhz": settled["sm_mhz"].median()})
    table = pd.DataFrame(rows).groupby("composition").median()
    flops = {}
    for name in table.index:
        plan = StepPlan(step=0, now_s=0.0)
        for key, value in features([tuple(it) for it in meta["compositions"][name]]).items():
            if hasattr(plan, key) and key != "num_decode_seqs":
                setattr(plan, key, value)
        flops[name] = step_flops(plan, counts)
    table["tflops"] = pd.Series(flops) / table["full_s"] / 1e12
    return table


def fit_settling(table: pd.DataFrame, max_mhz: float) -> tuple:
    """(knee TFLOP/s, MHz per TFLOP/s, floor MHz, RMS MHz) of the settling-clock line."""
    x, y = table["tflops"].to_numpy(), table["settling_mhz"].to_numpy()
    floor = float(np.nanmin(y))
    best = None
    for knee in np.arange(0.0, float(x.max()), 5.0):
        above = np.maximum(0.0, x - knee)
        if not above.any():
            continue
        slope = max(0.0, float(np.dot(above, max_mhz - y) / np.dot(above, above)))
        pred = np.clip(max_mhz - slope * above, floor, max_mhz)
        rms = float(np.sqrt(np.nanmean((pred - y) ** 2)))
        if best is None or rms < best[3]:
            best = (float(knee), slope, floor, rms)
    return best


def replay(steps: pd.DataFrame, table: pd.DataFrame, clock: ClockModel) -> np.ndarray:
    """Predicted seconds of every probe step, the clock state carried across the trace."""
    state = ClockState(clock)
    full = table["full_s"].to_dict()
    target = {n: clock.settling_mhz(t) for n, t in table["tflops"].items()}
    out = np.empty(len(steps))
    for i, (name, start, end) in enumerate(zip(steps["composition"], steps["start_s"],
                                               steps["end_s"])):
        out[i] = state.run_step(start, full[name], target[name])
        state.free_at_s = end          # the measured timeline, not the predicted one
    return out


def _rms_log(measured, predicted) -> float:
    e = np.log(measured / predicted)
    return float(np.sqrt(np.mean(e ** 2)))


def fit_clock(probe_dirs, model, profile_mhz: float) -> dict:
    """The clock model fitted to one or more probes (each its own lease of the GPU: its own
    full-clock times), with its errors (see the module doc)."""
    if isinstance(probe_dirs, (str, Path)):
        probe_dirs = [probe_dirs]
    probes = []
    for probe_dir in probe_dirs:
        steps, smi, meta = read_probe(probe_dir)
        steps = steps[steps["composition"].isin(meta["compositions"])].reset_index(drop=True)
        table = composition_table(steps, smi, meta, model)
        table["probe"] = str(probe_dir)
        probes.append((steps, table, float(smi["sm_mhz"].max())))
    tables = pd.concat([t for _, t, _ in probes])
    max_mhz = max(m for _, _, m in probes)
    knee, slope, floor, settle_rms = fit_settling(tables, max_mhz)
    steps = pd.concat([s for s, _, _ in probes], ignore_index=True)
    measured = steps["time_s"].to_numpy()
    train = steps["phase"].isin(FITTED_PHASES).to_numpy()
    held = (steps["phase"] == HELD_OUT_PHASE).to_numpy()
    base = np.concatenate([s["composition"].map(t["full_s"]).to_numpy() for s, t, _ in probes])

    def predict(clock):
        return np.concatenate([replay(s, t, clock) for s, t, _ in probes])

    best = None
    for s, down, up in itertools.product(SENSITIVITIES, TAUS_S, TAUS_S):
        clock = ClockModel(max_mhz, floor, knee, slope, float(s), down, up, profile_mhz)
        pred = predict(clock)
        rms = _rms_log(measured[train], pred[train])
        if best is None or rms < best[0]:
            best = (rms, clock, pred)
    rms, clock, pred = best
    by_phase = {}
    for phase in sorted(set(steps["phase"])):
        k = (steps["phase"] == phase).to_numpy()
        by_phase[phase] = {"steps": int(k.sum()),
                           "rms_log_error": round(_rms_log(measured[k], pred[k]), 4),
                           "rms_log_error_clock_blind": round(_rms_log(measured[k], base[k]), 4)}
    return {
        "format": CLOCK_FORMAT,
        "params": clock.to_dict(),
        "fit": {
            "probes": [str(p) for p in probe_dirs],
            "settling_rms_mhz": round(settle_rms, 1),
            "train_phases": list(FITTED_PHASES),
            "train_rms_log_error": round(rms, 4),
            "train_rms_log_error_clock_blind": round(_rms_log(measured[train], base[train]), 4),
            "held_out_phase": HELD_OUT_PHASE,
            "held_out_rms_log_error": round(_rms_log(measured[held], pred[held]), 4),
            "held_out_rms_log_error_clock_blind": round(_rms_log(measured[held], base[held]), 4),
            "held_out_median_abs_error": round(float(np.median(np.abs(
                pred[held] / measured[held] - 1))), 4),
            "held_out_median_abs_error_clock_blind": round(float(np.median(np.abs(
                base[held] / measured[held] - 1))), 4),
            "by_phase": by_phase,
        },
        "compositions": [{"probe": r.probe, "composition": n,
                          "full_ms": round(1e3 * r.full_s, 3),
                          "settling_mhz": round(r.settling_mhz, 1),
                          "tflops": round(r.tflops, 1)} for n, r in tables.iterrows()],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe_dirs", type=Path, nargs="+", help="clock probe folders")
    ap.add_argument("--model", required=True)
    ap.add_argument("--profile-mhz", type=float, required=True,
                    help="median SM clock over the profile's step grid (nvidia-smi beside it)")
    ap.add_argument("--profile-mhz-source", default="", help="where that figure was measured")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from simkv.core.specs import load_model
    try:
        result = fit_clock(args.probe_dirs, load_model(args.model), args.profile_mhz)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["params_source"] = {"profile_mhz": args.profile_mhz_source}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["fit"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
