"""Fit the clock model (`simkv.costmodel.clock`) to a clock probe's step traces.

    python -m simkv.fitting.clock PROBE_DIR [PROBE_DIR...] --model llama-3.1-8b \
        --out profiles/h200/llama-3.1-8b/clock.json

PROBE_DIR is what `research/clock_probe.py` wrote (steps.csv, smi.csv, meta.json); probes from
different leases of the GPU are pooled, each with its own full-clock times. In order:

1. each composition's time after a rest: the faster of the first two steps of each `self` case
   (after 0.4 s idle), median over the cases; its full-clock time is what the model needs to
   take that long from a rested state (a long heavy step pulls the clock down as it runs);
2. its settling clock: the median nvidia-smi SM clock over a `self` case after its first 0.3 s;
   the line `settling_mhz(TFLOP/s)` (knee and slope, floored at the lowest clock seen) by least
   squares over a grid of knees;
3. the share of time that scales with the clock, the controller's window and the clock's two
   time constants: for each window on its grid, coordinate descent over the other grids,
   minimizing the RMS log error of every step of the `self`, `recover` and `recover_idle`
   phases replayed through `ClockState` (the simulator's own code); the `duty` phase is held
   out and reported, against a clock-blind baseline (every step at its full-clock time), as
   is every phase on its own (`by_phase`; `sustain`: 3 s of heavy work, longer than the rest).

A probe with a `profile` phase (the profiler's grid with the probe's compositions in it) checks
how the clocked model reads a profile: each composition at its own settling clock
(`fit.profile_state`: the measured ratio of its time in the grid to its light-work time, and
the model's).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.costmodel.clock import ClockModel, ClockState, step_flops
from simkv.profile.format import CLOCK_FORMAT
from simkv.errors import InputError, read_json_object

SENSITIVITIES = tuple(float(x) for x in np.round(np.arange(0.10, 0.71, 0.05), 2))
TAUS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3)
WINDOWS_S = (0.0, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2)
MAX_ROUNDS = 6
HELD_OUT_PHASE = "duty"
FITTED_PHASES = ("self", "recover", "recover_idle")


def read_probe(probe_dir: Path) -> tuple:
    """(steps, smi, meta) of a clock probe; smi's `t_s` on the steps' clock."""
    probe_dir = Path(probe_dir)
    meta = read_json_object(probe_dir / "meta.json", "written by research/clock_probe.py")
    try:
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
    if not isinstance(meta.get("t0_unix"), (int, float)) \
            or not isinstance(meta.get("compositions"), dict):
        raise InputError(f"{probe_dir}/meta.json: needs t0_unix and compositions "
                         "(written by research/clock_probe.py)")
    try:
        stamp = pd.to_datetime(smi["timestamp"], format="%Y/%m/%d %H:%M:%S.%f")
    except ValueError:
        raise InputError(f"{probe_dir}/smi.csv: timestamps not as nvidia-smi writes them "
                         "(YYYY/MM/DD HH:MM:SS.fff)") from None
    smi["t_s"] = (stamp - pd.Timestamp("1970-01-01")).dt.total_seconds() - meta["t0_unix"]
    smi["sm_mhz"] = pd.to_numeric(smi[clock_column[0]], errors="coerce")
    steps = steps.sort_values("end_s").reset_index(drop=True)
    steps["start_s"] = steps["end_s"] - steps["time_s"]
    return steps, smi, meta


def composition_table(steps, smi, meta, model) -> pd.DataFrame:
    """Per composition: its first steps' seconds after a rest, settling clock (MHz) and TFLOP/s
    (at the first steps' speed)."""
    from simkv.profile.design import step_plan
    counts = model.forward_flops()
    self_steps = steps[steps["phase"] == "self"]
    if self_steps.empty:
        raise InputError("a clock probe without its `self` phase (every composition after a "
                         "rest) has no full-clock times")
    rows = []
    for (name, case_start), g in self_steps.groupby(
            ["composition", (self_steps["seq"] == 0).cumsum()]):
        settled = smi[(smi["t_s"] > g["start_s"].min() + 0.3) & (smi["t_s"] < g["end_s"].max())]
        rows.append({"composition": name, "first_s": g["time_s"].iloc[:2].min(),
                     "last_s": g["time_s"].iloc[-5:].median(),
                     "settling_mhz": settled["sm_mhz"].median()})
    table = pd.DataFrame(rows).groupby("composition").median()
    flops = {}
    for name in table.index:
        plan = step_plan([tuple(it) for it in meta["compositions"][name]], 16)
        flops[name] = step_flops(plan, counts)
    table["tflops"] = pd.Series(flops) / table["first_s"] / 1e12
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


def rested_full_seconds(clock: ClockModel, first_s: float, target_mhz: float) -> float:
    """The full-clock seconds of a composition whose first step after a rest took `first_s`
    (a long heavy step pulls the clock down while it runs)."""
    full = first_s
    for _ in range(3):
        full *= first_s / ClockState(clock).run_step(0.0, full, target_mhz)
    return full


def replay(steps: pd.DataFrame, table: pd.DataFrame, clock: ClockModel) -> np.ndarray:
    """Predicted seconds of every probe step, the clock state carried across the trace."""
    target = {n: clock.settling_mhz(t) for n, t in table["tflops"].items()}
    full = {n: rested_full_seconds(clock, first, target[n])
            for n, first in table["first_s"].items()}
    state = ClockState(clock)
    out = np.empty(len(steps))
    for i, (name, start, end) in enumerate(zip(steps["composition"], steps["start_s"],
                                               steps["end_s"])):
        out[i] = state.run_step(start, full[name], target[name])
        state.free_at_s = end          # the measured timeline, not the predicted one
    return out


def _rms_log(measured, predicted) -> float:
    e = np.log(measured / predicted)
    return float(np.sqrt(np.mean(e ** 2)))


def profile_state_check(probe_dir: Path, table: pd.DataFrame, clock: ClockModel) -> list:
    """Per probe composition timed inside the profiler's grid (`profile` phase): its time there
    over its light-work time (the faster of its first steps after a rest and its last steps
    back to back), against the model's slowdown at its settling clock."""
    path = Path(probe_dir) / "profile_state.csv"
    if not path.is_file():
        return []
    grid = pd.read_csv(path)
    grid = grid[grid["family"] == "probe"].set_index("id")["time_s"]
    out = []
    for name, r in table.iterrows():
        if name in grid:
            fast = min(r.first_s, r.last_s)
            out.append({"composition": name, "measured": round(float(grid[name] / fast), 4),
                        "model": round(clock.slowdown(clock.settling_mhz(r.tflops)), 4)})
    return out


def _read_probes(probe_dirs, model) -> list:
    """(steps, composition table, highest SM clock seen) per probe, its steps restricted to
    the compositions its meta.json lists."""
    probes = []
    for probe_dir in probe_dirs:
        steps, smi, meta = read_probe(probe_dir)
        steps = steps[steps["composition"].isin(meta["compositions"])].reset_index(drop=True)
        table = composition_table(steps, smi, meta, model)
        table["probe"] = str(probe_dir)
        probes.append((steps, table, float(smi["sm_mhz"].max())))
    return probes


def _search(probes: list, max_mhz: float, settling: tuple, measured, train) -> tuple:
    """(train RMS log error, clock, predicted step times) of the best controller parameters:
    for each controller window, coordinate descent over the other grids, each parameter in turn
    taking its best grid value given the others, until a whole round changes nothing."""
    knee, slope, floor, _ = settling
    grids = {"sensitivity": SENSITIVITIES, "tau_down_s": TAUS_S, "tau_up_s": TAUS_S}
    cache = {}

    def score(values):
        key = tuple(sorted(values.items()))
        if key not in cache:
            clock = ClockModel(max_mhz, floor, knee, slope,
                               **{k: float(v) for k, v in values.items()})
            pred = np.concatenate([replay(s, t, clock) for s, t, _ in probes])
            cache[key] = (_rms_log(measured[train], pred[train]), clock, pred)
        return cache[key]

    def descend(window):
        params = {"sensitivity": 0.3, "tau_window_s": window, "tau_down_s": 0.05,
                  "tau_up_s": 0.05}
        for _ in range(MAX_ROUNDS):
            before = dict(params)
            for name, grid in grids.items():
                params[name] = min(grid, key=lambda v: score(dict(params, **{name: v}))[0])
            if params == before:
                break
        return score(params)

    return min((descend(w) for w in WINDOWS_S), key=lambda r: r[0])


def _by_phase(steps: pd.DataFrame, measured, pred, base) -> dict:
    """Per phase: its steps and RMS log error, the model's and the clock-blind baseline's."""
    by_phase = {}
    for phase in sorted(set(steps["phase"])):
        k = (steps["phase"] == phase).to_numpy()
        by_phase[phase] = {"steps": int(k.sum()),
                           "rms_log_error": round(_rms_log(measured[k], pred[k]), 4),
                           "rms_log_error_clock_blind": round(_rms_log(measured[k], base[k]), 4)}
    return by_phase


def _profile_state(check: list) -> dict:
    """The profile-phase compositions and the mean error of reading them with and without the
    clock model."""
    return {"compositions": check,
            "mean_abs_error": round(float(np.mean([abs(c["model"] / c["measured"] - 1)
                                                   for c in check])), 4) if check else None,
            "mean_abs_error_as_measured": round(float(np.mean(
                [abs(1 / c["measured"] - 1) for c in check])), 4) if check else None}


def fit_clock(probe_dirs, model) -> dict:
    """The clock model fitted to one or more probes (each its own lease of the GPU: its own
    full-clock times), with its errors (see the module doc)."""
    if isinstance(probe_dirs, (str, Path)):
        probe_dirs = [probe_dirs]
    probes = _read_probes(probe_dirs, model)
    tables = pd.concat([t for _, t, _ in probes])
    max_mhz = max(m for _, _, m in probes)
    settling = fit_settling(tables, max_mhz)
    if settling is None:
        raise InputError(f"{', '.join(map(str, probe_dirs))}: no composition above the lowest "
                         "FLOP rate: the settling clock cannot be fitted")
    steps = pd.concat([s for s, _, _ in probes], ignore_index=True)
    measured = steps["time_s"].to_numpy()
    train = steps["phase"].isin(FITTED_PHASES).to_numpy()
    held = (steps["phase"] == HELD_OUT_PHASE).to_numpy()
    base = np.concatenate([s["composition"].map(t["first_s"]).to_numpy() for s, t, _ in probes])
    rms, clock, pred = _search(probes, max_mhz, settling, measured, train)
    check = [dict(row, probe=str(d)) for (_, t, _), d in zip(probes, probe_dirs)
             for row in profile_state_check(d, t, clock)]
    return {
        "format": CLOCK_FORMAT,
        "params": clock.to_dict(),
        "fit": {
            "probes": [str(p) for p in probe_dirs],
            "settling_rms_mhz": round(settling[3], 1),
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
            "by_phase": _by_phase(steps, measured, pred, base),
            "profile_state": _profile_state(check),
        },
        "compositions": [{"probe": r.probe, "composition": n,
                          "first_ms": round(1e3 * r.first_s, 3),
                          "settling_mhz": round(r.settling_mhz, 1),
                          "tflops": round(r.tflops, 1)} for n, r in tables.iterrows()],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe_dirs", type=Path, nargs="+", help="clock probe folders")
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from simkv.specs import load_model
    try:
        result = fit_clock(args.probe_dirs, load_model(args.model))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["fit"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
