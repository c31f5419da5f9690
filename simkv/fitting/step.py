"""The step-time fit: the device-work and host-floor coefficients of every block size, the form
chosen by cross-validation on the training rows (formula: `simkv.fitting.fit`'s docstring)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from simkv.costmodel.step_formula import BATCH_KNOTS, FORMS, layout_from_meta, predict_step
from simkv.fitting.numerics import close_enough, rel_error_summary, rms, solve_relative
from simkv.fitting.step_design import (CV_FOLDS, coef_names, joint_design, pack_step_coefs,
                                       with_design_items)

# form/sharing, simplest first: "shared" fits one linear-layer curve and one set of host terms
# for all block sizes (only attention terms per block size); "per_block_size" fits all per size.
# Each with or without the eager steps' host floor ("/floor": t = max(device work, h0 + h_seq x
# sequences)); without it is simpler (an 8B's eager steps are never host-bound, and a floor
# fitted there explains device work instead).
FORM_SHARINGS = ("base/shared", "batch/shared", "base/per_block_size", "batch/per_block_size")
FLOORS = ("", "/floor")
CANDIDATES = tuple(f"{form}{floor}" for form in FORM_SHARINGS for floor in FLOORS)
HOLDOUT_EVERY = 5           # every 5th composition of each family (by design order) ...
HOLDOUT_MIXED_ROW = 32      # ... and every mixed composition with this many decodes
HOLDOUT_RULE = (f"per block size and family, in design order: every {HOLDOUT_EVERY}th composition "
                f"(index % {HOLDOUT_EVERY} == {HOLDOUT_EVERY - 1}); plus every mixed composition "
                f"with {HOLDOUT_MIXED_ROW} decode sequences")
# Candidate decode programs resident per SM (StepLayout.decode_slots_per_sm; 0: the busiest
# program counts in full); the fit takes the one that cross-validates best for each form.
DECODE_SLOTS = (0, 2, 3, 4, 5, 6, 7, 8)
# Candidate prefill programs resident per SM (StepLayout.prefill_slots_per_sm; 0: no prefill
# tail term), chosen after the form and the decode slots.
PREFILL_SLOTS = (0, 1, 2, 3, 4, 6, 8)


def holdout_mask(steps: pd.DataFrame) -> np.ndarray:
    """Which rows are held out: the rule in HOLDOUT_RULE, applied to the design order only."""
    held = np.zeros(len(steps), dtype=bool)
    for _, idx in steps.groupby(["block_size", "family"], sort=False).groups.items():
        for rank, i in enumerate(idx):
            if rank % HOLDOUT_EVERY == HOLDOUT_EVERY - 1:
                held[steps.index.get_loc(i)] = True
    mixed_row = (steps["family"] == "mixed") & (steps["num_decode_seqs"] == HOLDOUT_MIXED_ROW)
    return held | mixed_row.to_numpy()



def _predict_rows(x, hx, eager, c, h) -> np.ndarray:
    gpu = x @ c
    return np.where(eager, np.maximum(gpu, hx @ h), gpu)


def _alternate(x, hx, t, eager, host, max_iter: int = 40) -> tuple:
    """From an assignment of eager rows to the host floor: fit `c` on the device-bound rows and
    `h` on the host-bound ones, re-assign each eager row to the larger term, repeat. Returns
    (RMS relative error, c, h) of the best assignment seen (stops when the assignment settles
    or 8 rounds bring no improvement)."""
    best = None
    c = np.zeros(x.shape[1])
    h = np.zeros(hx.shape[1])
    for _ in range(max_iter):
        c = solve_relative(x[~host], t[~host], c > 0) if (~host).any() else np.zeros(x.shape[1])
        h = solve_relative(hx[host], t[host], h > 0) if host.any() else np.zeros(hx.shape[1])
        pred = _predict_rows(x, hx, eager, c, h)
        score = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
        if best is None or score < best[0] - 1e-12:
            best, stale = (score, c, h), 0
        else:
            stale += 1
        new = eager & (hx @ h > x @ c)
        if (new == host).all() or stale >= 8:     # settled, or cycling without improving
            break
        host = new
    return best


def _fit_rows(x, hx, t, eager, floor: bool = True) -> tuple:
    """(device-work coefficients, host-floor coefficients) of `t = max(x c, hx h)` for eager
    rows and `t = x c` for graphed ones, by alternating least squares from several starts (none,
    or the fastest 20, 40 or 60% of eager rows taken as host-bound); the start with the
    smallest RMS relative error wins. Without `floor`, h = 0: `t = x c` for every row."""
    starts = [np.zeros(len(t), bool)]
    if eager.any() and floor:
        for q in (20, 40, 60):
            starts.append(eager & (t <= np.percentile(t[eager], q)))
    best = min((_alternate(x, hx, t, eager, host) for host in starts), key=lambda r: r[0])
    return best[1], best[2]


def _cv_errors(x, hx, t, eager, fold, floor: bool = True) -> np.ndarray:
    """Relative errors of a deterministic CV_FOLDS-fold cross-validation (`fold` per row)."""
    err = np.empty(len(t))
    for k in range(CV_FOLDS):
        test = fold == k
        c, h = _fit_rows(x[~test], hx[~test], t[~test], eager[~test], floor)
        err[test] = np.abs(_predict_rows(x[test], hx[test], eager[test], c, h) - t[test]) / t[test]
    return err



FORM_SELECTION_METHOD = (f"{CV_FOLDS}-fold cross-validation (fold = position in "
                         f"the design % {CV_FOLDS}) on training rows only; per "
                         "candidate the decode_slots_per_sm of DECODE_SLOTS with "
                         "the smallest RMS, then the simplest candidate within 5% "
                         "of the best RMS relative error (candidates simplest "
                         "first; '/floor': with the eager steps' host floor); "
                         "then, for it, the prefill_slots_per_sm of PREFILL_SLOTS "
                         "with the smallest RMS unless 0 (no prefill tail) is "
                         "within 5% of it")


def _cv_by_candidate(train: pd.DataFrame, layout, block_sizes: list) -> dict:
    """Each candidate's CV error at the decode_slots_per_sm of DECODE_SLOTS that gives it the
    smallest RMS, with the RMS of every slot count (`rms_by_decode_slots`)."""
    t_train = train["time_s"].to_numpy(float)
    cv = {}
    for form_sharing in FORM_SHARINGS:
        form, sharing = form_sharing.split("/")
        # one design per slot count serves the candidates with and without the host floor
        for slots in DECODE_SLOTS:
            trial = replace(layout, decode_slots_per_sm=float(slots))
            x, hx, eager, rows, fold, _ = joint_design(train, form, sharing, trial, block_sizes)
            for floor in FLOORS:
                name = form_sharing + floor
                errs = _cv_errors(x, hx, t_train[rows], eager, fold, bool(floor))
                score = {"median": round(float(np.median(errs)), 4),
                         "p95": round(float(np.percentile(errs, 95)), 4),
                         "rms": rms(errs),
                         "decode_slots_per_sm": slots}
                rms_by_slots = cv[name]["rms_by_decode_slots"] if name in cv else {}
                rms_by_slots[str(slots)] = score["rms"]
                if name not in cv or score["rms"] < cv[name]["rms"]:
                    cv[name] = score
                cv[name]["rms_by_decode_slots"] = rms_by_slots
    return cv


def _prefill_slots(train: pd.DataFrame, form: str, sharing: str, floor: bool, layout,
                   block_sizes: list) -> tuple:
    """(RMS by prefill_slots_per_sm of PREFILL_SLOTS, the count chosen): by CV on the same
    folds, 0 (no prefill tail term) unless another count is more than 5% better."""
    t_train = train["time_s"].to_numpy(float)
    rms_by_prefill = {}
    for slots in PREFILL_SLOTS:
        trial = replace(layout, prefill_slots_per_sm=float(slots))
        x, hx, eager, rows, fold, _ = joint_design(train, form, sharing, trial, block_sizes)
        errs = _cv_errors(x, hx, t_train[rows], eager, fold, floor)
        rms_by_prefill[slots] = rms(errs)
    best = min(rms_by_prefill, key=lambda k: (rms_by_prefill[k], k))
    chosen = 0 if close_enough(rms_by_prefill[0], rms_by_prefill[best]) else best
    return rms_by_prefill, chosen


def _predict_every_row(steps: pd.DataFrame, coefs_by_bs: dict, layout) -> tuple:
    """(predicted seconds, regime) of every row: graphed, eager, or eager at the host floor."""
    pred = np.empty(len(steps))
    regime = np.empty(len(steps), dtype=object)
    for bs, coefs in coefs_by_bs.items():
        bs = int(bs)
        no_floor = dict(coefs, host_floor_s=0.0, host_floor_s_per_seq=0.0)
        for j in np.flatnonzero((steps["block_size"] == bs).to_numpy()):
            row = steps.loc[j]
            pred[j] = predict_step(coefs, row, layout, bs)
            regime[j] = "graphed" if row["graph"] else (
                "eager_at_host_floor" if pred[j] > predict_step(no_floor, row, layout, bs)
                else "eager")
    return pred, regime


def _error_summary(steps: pd.DataFrame, pred, regime, mask, block_sizes: list) -> dict:
    """Relative errors of the rows in `mask`: over all, by family, block size and regime."""
    t_all = steps["time_s"].to_numpy(float)
    out = rel_error_summary(pred[mask], t_all[mask])
    family = steps["family"].to_numpy()
    out["by_family"] = {fam: rel_error_summary(pred[mask & (family == fam)],
                                               t_all[mask & (family == fam)])
                        for fam in sorted(set(family))}
    out["by_block_size"] = {str(bs): rel_error_summary(
        pred[mask & (steps["block_size"] == bs).to_numpy()],
        t_all[mask & (steps["block_size"] == bs).to_numpy()]) for bs in block_sizes}
    # graphed decode steps; eager steps; eager steps the fitted host floor decides
    out["by_regime"] = {r: rel_error_summary(pred[mask & (regime == r)],
                                             t_all[mask & (regime == r)])
                        for r in ("graphed", "eager", "eager_at_host_floor")}
    return out


def fit_steps(steps: pd.DataFrame, meta: dict | None = None) -> dict:
    """Fit the step model of every block size; choose the form by cross-validation on the
    training rows (the held-out rows are never seen before the final error)."""
    steps = steps.reset_index(drop=True)
    layout = replace(layout_from_meta(meta or {}, int((steps["num_prefill_tokens"]
                                                       + steps["num_decode_tokens"]).max())),
                     decode_tail_in_order=True)
    steps = with_design_items(steps, layout)
    held = holdout_mask(steps)
    token_knots = list(layout.token_knots)
    block_sizes = sorted(int(b) for b in steps["block_size"].unique())
    train = steps[~held].reset_index(drop=True)

    cv = _cv_by_candidate(train, layout, block_sizes)
    # The simplest candidate whose CV RMS error is within 5% (relative) of the best one.
    best = min(v["rms"] for v in cv.values())
    chosen = next(n for n in CANDIDATES if close_enough(cv[n]["rms"], best))
    form, sharing, *floor = chosen.split("/")
    layout = replace(layout, decode_slots_per_sm=float(cv[chosen]["decode_slots_per_sm"]))
    rms_by_prefill, prefill_slots = _prefill_slots(train, form, sharing, bool(floor), layout,
                                                   block_sizes)
    layout = replace(layout, prefill_slots_per_sm=float(prefill_slots))

    x, hx, eager, rows, _, unpack = joint_design(train, form, sharing, layout, block_sizes)
    c_all, h_all = _fit_rows(x, hx, train["time_s"].to_numpy(float)[rows], eager, bool(floor))
    per_bs = {str(bs): pack_step_coefs(*unpack(c_all, h_all, i), form, token_knots, layout)
              for i, bs in enumerate(block_sizes)}
    pred, regime = _predict_every_row(steps, per_bs, layout)
    return {
        "form": form,
        "sharing": sharing,
        "host_floor": bool(floor),
        "block_sizes": block_sizes,
        "token_knots": token_knots,
        "batch_knots": list(BATCH_KNOTS) if FORMS[form] else [],
        "graph_batch_sizes": list(layout.graph_batch_sizes),
        "layout": layout.to_json(),
        "coefficient_names": coef_names(form, token_knots, layout),
        "step": per_bs,
        "holdout": {"rule": HOLDOUT_RULE,
                    "ids": sorted(set(steps.loc[held, "id"].astype(str))),
                    "rows": int(held.sum())},
        "holdout_error": _error_summary(steps, pred, regime, held, block_sizes),
        "train_error": _error_summary(steps, pred, regime, ~held, block_sizes),
        "form_selection": {"method": FORM_SELECTION_METHOD,
                           "decode_slots_candidates": list(DECODE_SLOTS),
                           "prefill_slots_candidates": list(PREFILL_SLOTS),
                           "rms_by_prefill_slots": {str(k): v for k, v in
                                                    rms_by_prefill.items()},
                           "prefill_slots_per_sm": prefill_slots,
                           "candidates": list(CANDIDATES), "cv_error": cv, "chosen": chosen},
    }
