"""Per-step diagnostics of a validation: the cost model's error on the engine's own plans.

    python -m simkv.validation.diagnostics RESULT.json...     # served-step error per result
    python -m simkv.validation.diagnostics --split RESULT.json...   # where decode steps' time went

The simulator replays the engine's step times (`_PlanReplay`) so both keep the same schedule;
each matched step's prediction is set against the step's duration and the executor span the
profile measured, and the host time outside that span is fitted per sequence and token.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from simkv.errors import InputError
from simkv.validation.metrics import ERROR_KEYS, lookup, relative_error

LARGE_BATCH = 128           # decode batches above this are reported apart in the step diagnostic
KINDS = ("decode_graph", "mixed_graph", "eager")


class _PlanReplay:
    """Cost model for the diagnostic: while the simulator's plans match the engine's steps
    (same index, same prefill and decode tokens) it advances the clock to the engine's next step
    start (or by the step's duration before an idle gap), so arrivals meet the same steps and
    both runs keep the same schedule; it records what the model predicted for each such plan."""

    IDLE_GAP_S = 1e-3        # a longer gap between two engine steps was a wait for arrivals

    def __init__(self, inner, steps: pd.DataFrame):
        self.inner, self.name = inner, inner.name
        self.tokens = list(zip(steps["num_prefill_tokens"].astype(int).tolist(),
                               steps["num_decode_tokens"].astype(int).tolist()))
        self.start_s = steps["start_s"].to_numpy(dtype=np.float64)
        self.duration_s = steps["duration_s"].to_numpy(dtype=np.float64)
        self.span_s = (steps["span_s"].to_numpy(dtype=np.float64) if "span_s" in steps
                       else np.full(len(steps), np.nan))
        self.rows = []
        self.matching = True
        self.host_seconds = getattr(inner, "host_seconds", None)   # a profiled model's

    def reset(self) -> None:
        if hasattr(self.inner, "reset"):
            self.inner.reset()

    def predict(self, plan) -> float:
        predicted = self.inner.predict(plan)
        k = len(self.rows)
        if self.matching and k < len(self.tokens) \
                and self.tokens[k] == (plan.num_prefill_tokens, plan.num_decode_tokens):
            decodes = len(plan.scheduled) - plan.num_prefill_seqs
            layout = getattr(self.inner, "layout", None)
            graphed = layout.is_graphed(plan.num_prefill_tokens, decodes) if layout is not None \
                else plan.num_prefill_tokens == 0 and decodes <= 256
            kind = ("eager" if not graphed else
                    "mixed_graph" if plan.num_prefill_tokens else "decode_graph")
            host = self.host_seconds(plan) if self.host_seconds is not None else np.nan
            self.rows.append((predicted, self.duration_s[k], self.span_s[k], kind,
                              len(plan.scheduled), plan.num_prefill_tokens, decodes, host))
            end = self.start_s[k] + self.duration_s[k]
            if k + 1 < len(self.start_s) and self.start_s[k + 1] - end < self.IDLE_GAP_S:
                return max(1e-9, float(self.start_s[k + 1] - plan.now_s))
            return max(1e-9, float(end - plan.now_s))
        self.matching = False
        return predicted


def step_diagnostics(scenario, frame, measured: dict, cost_model) -> dict:
    """Per-step error of the cost model on the engine's own plans (the simulator replays the
    engine's step times; `matched_steps` of `steps` kept the same schedule), against the step's
    duration and against the executor span the profile measured; the engine's host time outside
    that span; and `replayed_error`: the replay's metrics against the measured ones (near zero
    when the simulator and the engine make the same decisions, so that the headline errors are
    step-time errors)."""
    from simkv.sim.engine import simulate
    steps = measured["steps"]
    replay = _PlanReplay(cost_model, steps)
    replayed = simulate(scenario, trace_df=frame, cost_model=replay).summary
    out = {"steps": int(len(steps)), "matched_steps": len(replay.rows),
           "host_outside_span_fraction": _outside_fraction(steps),
           "replayed_error": {k: relative_error(lookup(replayed, k), lookup(measured["summary"], k))
                              for k in ERROR_KEYS[:5]}}
    rows = pd.DataFrame(replay.rows, columns=["predicted_s", "duration_s", "span_s", "kind",
                                              "num_seqs", "num_prefill_tokens", "num_decodes",
                                              "host_s"])
    if rows.span_s.notna().all() and len(rows) >= 3:
        out["host_outside_span_fit"] = _fit_host_term(rows)
    large = rows.num_decodes > LARGE_BATCH
    families = [(kind, rows[rows.kind == kind]) for kind in KINDS]
    families += [(f"{kind}_over_{LARGE_BATCH}_decodes", rows[(rows.kind == kind) & large])
                 for kind in ("decode_graph", "eager")]
    for family, part in families:
        if part.empty:
            continue
        entry = {"steps": int(len(part)),
                 "time_fraction": float(part.duration_s.sum() / rows.duration_s.sum()),
                 "duration_ms_mean": 1e3 * float(part.duration_s.mean()),
                 "predicted_ms_mean": 1e3 * float(part.predicted_s.mean()),
                 "error_vs_duration_median": float((part.predicted_s / part.duration_s - 1)
                                                   .median()),
                 "error_vs_duration_total": float(part.predicted_s.sum()
                                                  / part.duration_s.sum() - 1)}
        if part.span_s.notna().all():
            entry["span_ms_mean"] = 1e3 * float(part.span_s.mean())
            entry["error_vs_span_median"] = float((part.predicted_s / part.span_s - 1).median())
            entry["error_vs_span_total"] = float(part.predicted_s.sum() / part.span_s.sum() - 1)
            entry["host_outside_span_ms_mean"] = 1e3 * float((part.duration_s
                                                              - part.span_s).mean())
            if part.host_s.notna().all():
                # the prediction split: what the executor runs (the forward, copies, swaps)
                # against its span; the engine's host term against the time outside the span
                entry["forward_error_vs_span_total"] = float(
                    (part.predicted_s - part.host_s).sum() / part.span_s.sum() - 1)
                entry["predicted_host_ms_mean"] = 1e3 * float(part.host_s.mean())
        out[family] = entry
    return out


def decode_time_split(steps: pd.DataFrame) -> dict:
    """Where a measured run's decode-only steps spent their time, per step on average (ms): the
    device (`gpu`: the executor's CUDA-event span less the host input preparation inside it),
    that preparation (`prep`), and the engine's host time outside the span (`outside`); with
    the mean sequences per step. The lease-to-lease differences of the validation runs are
    mostly in the two host terms."""
    need = {"num_prefill_tokens", "duration_s", "span_s", "prep_s", "num_seqs"}
    if not need <= set(steps.columns):
        raise InputError(f"steps.csv needs columns {sorted(need)} (a run measured by "
                         "simkv validate measure)")
    steps = steps[sorted(need)].apply(pd.to_numeric, errors="coerce")
    if steps.isna().any().any():
        bad = steps.columns[steps.isna().any()][0]
        raise InputError(f"steps.csv column '{bad}' has empty or non-numeric values")
    dec = steps[steps["num_prefill_tokens"] == 0]
    if dec.empty:
        raise InputError("steps.csv has no decode-only step")
    ms = lambda col: round(1e3 * float(col.mean()), 4)      # noqa: E731
    return {"steps": int(len(dec)), "num_seqs_mean": round(float(dec["num_seqs"].mean()), 2),
            "duration_ms": ms(dec["duration_s"]), "gpu_ms": ms(dec["span_s"] - dec["prep_s"]),
            "prep_ms": ms(dec["prep_s"]), "outside_ms": ms(dec["duration_s"] - dec["span_s"])}


def _fit_host_term(rows: pd.DataFrame) -> dict:
    """Least squares of the host time outside the executor span per step: c0_s + c_seq_s x
    sequences + c_prefill_token_s x prefill tokens (the term the profiled model lacks)."""
    x = np.c_[np.ones(len(rows)), rows.num_seqs, rows.num_prefill_tokens].astype(np.float64)
    coef, *_ = np.linalg.lstsq(x, (rows.duration_s - rows.span_s).to_numpy(), rcond=None)
    return dict(zip(("c0_s", "c_seq_s", "c_prefill_token_s"), map(float, np.maximum(coef, 0))))


def _outside_fraction(steps: pd.DataFrame) -> float | None:
    if "span_s" not in steps or steps["span_s"].isna().any():
        return None
    return float((steps["duration_s"] - steps["span_s"]).sum() / steps["duration_s"].sum())


def served_step_error(result: dict, run: str = "realtime") -> float:
    """One number for how well a cost model times the steps a run served: the mean over the
    step kinds of |total predicted / total duration - 1|, weighted by the kind's share of the
    run's time (a validation result's `steps[run]`, its matched steps). InputError when the
    result has no such diagnostic or no matched step."""
    steps = result.get("steps") if isinstance(result, dict) else None
    steps = steps.get(run) if isinstance(steps, dict) else None
    if not isinstance(steps, dict) or not steps.get("matched_steps"):
        raise InputError(f"no per-step diagnostic with matched steps (steps.{run}); a result of "
                         "simkv validate compare has one")
    try:
        return sum(float(steps[kind]["time_fraction"])
                   * abs(float(steps[kind]["error_vs_duration_total"]))
                   for kind in KINDS if kind in steps)
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"steps.{run}: a step kind without time_fraction and "
                         f"error_vs_duration_total ({e})") from None


def main(argv=None) -> int:
    import argparse
    import sys
    from simkv.errors import read_json_object
    parser = argparse.ArgumentParser(prog="python -m simkv.validation.diagnostics",
                                     description="The served-step error of validation results "
                                                 "(real-time runs) and their mean.")
    parser.add_argument("results", nargs="+", help="validation result JSONs")
    parser.add_argument("--split", action="store_true",
                        help="instead: per result, the measured real-time run's decode-only "
                             "steps split into device, host input preparation and host time "
                             "outside the executor (ms per step; read from the result's "
                             "measured_dir)")
    args = parser.parse_args(argv)
    if args.split:
        return _print_splits(args.results)
    errors = []
    try:
        for path in args.results:
            result = read_json_object(path, "a result of simkv validate compare")
            try:
                errors.append(served_step_error(result))
            except InputError as e:
                raise InputError(f"{path}: {e}") from None
            steps = result["steps"]["realtime"]
            print(f"{path}\t{result.get('cost_model')}\t{100 * errors[-1]:.2f}%\t"
                  f"({steps['matched_steps']} of {steps.get('steps')} steps matched)")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"mean of {len(errors)}\t{100 * float(np.mean(errors)):.2f}%")
    return 0


def _print_splits(paths) -> int:
    import sys
    from pathlib import Path
    from simkv.errors import read_json_object
    print("result\tsteps\tseqs\tduration_ms\tgpu_ms\tprep_ms\toutside_ms")
    try:
        for path in paths:
            result = read_json_object(path, "a result of simkv validate compare")
            steps_csv = Path(str(result.get("measured_dir", ""))) / "realtime" / "steps.csv"
            try:
                steps = pd.read_csv(steps_csv)
            except (OSError, ValueError) as e:
                raise InputError(f"{path}: cannot read its measured run {steps_csv} "
                                 f"({' '.join(str(e).split())}); run from the repository root"
                                 ) from None
            try:
                split = decode_time_split(steps)
            except InputError as e:
                raise InputError(f"{steps_csv}: {e}") from None
            print(f"{path}\t{split['steps']}\t{split['num_seqs_mean']:.1f}\t"
                  f"{split['duration_ms']:.3f}\t{split['gpu_ms']:.3f}\t{split['prep_ms']:.3f}\t"
                  f"{split['outside_ms']:.3f}")
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
