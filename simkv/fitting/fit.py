"""Fit the profiled step-cost model from a profile's raw CSVs (numpy only; no torch, no scipy).

The device work of a forward step of N batched tokens on a given block size (seconds):

    G = T_lin(N_eff)                                  linear layers, LM head, launches: values
                                                      at token knots (never decreasing), linear
                                                      in between
      + a_dec(B) * decode_context_tokens              decode attention (KV read); a_dec one
                                                      value, or interpolated between batch knots
      + a_long * decode_tail_tokens                   when the decode kernel's last program
                                                      ends beyond an even share of the batch's
                                                      KV over the GPU's program slots, its
                                                      programs list-scheduled in batch order
                                                      (StepLayout.decode_tail_tokens)
      + a_pf  * prefill_attention_pairs               prefill attention work (causal q-k pairs)
      + a_ctx * prefill_context_tokens                prefill attention's KV read
      + a_ptail * prefill_tail_tokens               the prefill kernel's busiest program beyond
                                                      an even share of all its programs' keys
                                                      over the GPU's slots (when the CV
                                                      chooses prefill slots; StepLayout)
      + c_seq * num_seqs                              per-sequence input building, sampling
      + c_prefill_row * N_eff * [step has prefill chunks]    what a step with chunks costs per
                                                      row beyond a decode step of as many
                                                      rows (T_lin is pinned by decode graphs
                                                      up to 256 rows, by chunked steps above)
      + (c_mixed + c_mixed_seq * num_decode_seqs) * [graphed mixed step]
                                                      a mixed graph's fixed extra and its
                                                      per-item input building
      + c_eager * [step runs eagerly]

N_eff is N, or the CUDA-graph size a graphed step is padded to: the batch size of a decode-only
step, the token count of a step with prefill chunks (StepLayout). A graphed step takes G. An
eager step launches every kernel from Python, so when its device work is small the host can be
the bottleneck: with a host floor it takes max(G, h0 + h_seq * num_seqs), without one G. The
attention terms are fitted per block size; T_lin and the host terms either per block size or
shared by all of them, the decode cost per token one value or interpolated over the batch, and
the host floor in or out, whichever cross-validates better (CANDIDATES, simplest first).
Fitting is non-negative least squares on relative error, alternating between the two regimes
of eager steps when there is a floor. Block copies and host<->device swaps are
fitted separately as `c0 + c_block * blocks + c_byte * bytes`.

Held-out step compositions are chosen by a rule on the design (never on measured times) before
any fitting and listed in the fit; `holdout_error` is the relative error on them.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.costmodel.step_formula import (BATCH_KNOTS, FORMS, LOG_BATCH_KNOTS, StepLayout,
                                          hats, layout_from_meta, predict_step)
from simkv.errors import InputError, read_json_object
from simkv.profile.format import ENGINE_PASS_BLOCK_SIZE, FIT_FORMAT

STEP_COLUMNS = (
    "id", "family", "block_size", "num_prefill_tokens", "num_decode_tokens", "num_prefill_seqs",
    "num_decode_seqs", "decode_context_tokens", "prefill_context_tokens",
    "prefill_attention_pairs", "decode_max_context", "graph", "time_s",
)
TRANSFER_COLUMNS = ("block_size", "num_blocks", "bytes", "time_s")
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
CV_FOLDS = 5
# Candidate decode programs resident per SM (StepLayout.decode_slots_per_sm; 0: the busiest
# program counts in full); the fit takes the one that cross-validates best for each form.
DECODE_SLOTS = (0, 2, 3, 4, 5, 6, 7, 8)
# Candidate prefill programs resident per SM (StepLayout.prefill_slots_per_sm; 0: no prefill
# tail term), chosen after the form and the decode slots.
PREFILL_SLOTS = (0, 1, 2, 3, 4, 6, 8)
SIG_DIGITS = 6


# ----------------------------------------------------------------------------------------------
# Small numerics


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None,
         start: np.ndarray | None = None) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson & Hanson's active-set method, on the normal
    equations: the subproblems are as small as the number of columns). `start`: a guess of the
    positive coefficients (a boolean mask), used when its unconstrained solution is positive."""
    n = a.shape[1]
    gram, atb = a.T @ a, a.T @ b
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = atb.copy()
    tol = 1e-10 * max(1.0, float(np.abs(atb).max(initial=0.0)))

    def solve(mask):
        z = np.zeros(n)
        sub, rhs = gram[np.ix_(mask, mask)], atb[mask]
        try:
            zp = np.linalg.solve(sub, rhs)
            r = sub @ zp - rhs
            if np.isfinite(zp).all() and r @ r <= 1e-16 * (rhs @ rhs):
                z[mask] = zp
                return z
        except np.linalg.LinAlgError:
            pass
        z[mask] = np.linalg.lstsq(sub, rhs, rcond=1e-12)[0]   # collinear columns
        return z

    if start is not None and start.any():
        z = solve(start)
        if (z[start] > 0).all():
            passive, x = start.copy(), z
            w = atb - gram @ x
    for _ in range(max_iter or 3 * n + 30):
        if passive.all() or (w[~passive] <= tol).all():
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = solve(passive)
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-300
            x[~passive] = 0.0
        w = atb - gram @ x
    return x


def solve_relative(x: np.ndarray, t: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """Non-negative coefficients minimising the sum of squared relative errors of x @ c vs t
    (`start`: the coefficients expected to be positive, a warm start)."""
    a = x / t[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    return nnls(a / scale, np.ones(len(t)), start=start) / scale


def _round(value: float, digits: int = SIG_DIGITS) -> float:
    if value == 0 or not math.isfinite(value):
        return float(value)
    return float(f"{value:.{digits}g}")


def _rms(err) -> float:
    """Root mean square of relative errors, rounded as the fit reports it."""
    return round(float(np.sqrt(np.mean(np.asarray(err) ** 2))), 4)


def _close_enough(rms: float, best: float) -> bool:
    """The CV rule: a simpler choice wins when its RMS is within 5% (relative) of the best."""
    return rms <= best * 1.05 + 1e-12


def rel_error_summary(pred, meas) -> dict:
    """{median, p95, max, count} of |pred - meas| / meas."""
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    if len(meas) == 0:
        return {"median": None, "p95": None, "max": None, "count": 0}
    err = np.abs(pred - meas) / meas
    return {"median": round(float(np.median(err)), 4),
            "p95": round(float(np.percentile(err, 95)), 4),
            "max": round(float(err.max()), 4), "count": int(len(err))}


# ----------------------------------------------------------------------------------------------
# Reading a profile


def read_csv(path: Path, columns) -> pd.DataFrame:
    """A raw CSV with the given required columns (InputError naming the file and column)."""
    if not path.is_file():
        raise InputError(f"{path}: missing (a profile directory holds steps.csv, swap.csv, "
                         "copy.csv and meta.json from `simkv profile`)")
    try:
        df = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a readable CSV ({' '.join(str(e).split())})") from None
    for col in columns:
        if col not in df.columns:
            raise InputError(f"{path}: missing column '{col}' (needs {', '.join(columns)})")
    numeric = [c for c in columns if c not in ("id", "family", "direction")]
    bad = df[numeric].apply(pd.to_numeric, errors="coerce").isna().any()
    if bad.any():
        raise InputError(f"{path}: column '{bad[bad].index[0]}' has empty or non-numeric values")
    return df


def read_meta(profile_dir: Path) -> dict:
    path = Path(profile_dir) / "meta.json"
    if not path.is_file():
        return {}
    return read_json_object(path, "written by `simkv profile`")


def holdout_mask(steps: pd.DataFrame) -> np.ndarray:
    """Which rows are held out: the rule in HOLDOUT_RULE, applied to the design order only."""
    held = np.zeros(len(steps), dtype=bool)
    for _, idx in steps.groupby(["block_size", "family"], sort=False).groups.items():
        for rank, i in enumerate(idx):
            if rank % HOLDOUT_EVERY == HOLDOUT_EVERY - 1:
                held[steps.index.get_loc(i)] = True
    mixed_row = (steps["family"] == "mixed") & (steps["num_decode_seqs"] == HOLDOUT_MIXED_ROW)
    return held | mixed_row.to_numpy()


# ----------------------------------------------------------------------------------------------
# Step features and prediction (shared with ProfiledCostModel)


def with_design_items(steps: pd.DataFrame) -> pd.DataFrame:
    """`steps` with a `decode_contexts` column: each row's decode context lengths in batch order,
    from the profiler's design by id, kept only where they agree with the row's own features
    (count, total and longest context); None otherwise (an id the design does not have, or a
    composition changed under its id): the tail then takes the longest sequence first. And a
    `prefill_chunks` column: the row's (cached prefix, tokens) chunks from the design, kept where
    they agree with its prefill tokens and context (None: no prefill tail for the row)."""
    from simkv.profile.design import decode_contexts_by_id, prefill_chunks_by_id
    lookup, chunk_lookup = decode_contexts_by_id(), prefill_chunks_by_id()
    contexts, chunks = [], []
    for row in steps[["id", "num_decode_seqs", "decode_context_tokens", "decode_max_context",
                      "num_prefill_tokens", "prefill_context_tokens"]].itertuples(index=False):
        found = lookup.get(str(row.id))
        agrees = found is not None and (len(found), sum(found), max(found, default=0)) == (
            int(row.num_decode_seqs), int(row.decode_context_tokens), int(row.decode_max_context))
        contexts.append(found if agrees else None)
        found = chunk_lookup.get(str(row.id))
        agrees = found is not None and (sum(n for _, n in found), sum(s + n for s, n in found)) \
            == (int(row.num_prefill_tokens), int(row.prefill_context_tokens))
        chunks.append(found if agrees else None)
    return steps.assign(decode_contexts=contexts, prefill_chunks=chunks)


def feature_row(f, form: str, layout: StepLayout, block_size: int) -> list:
    """The row of the device-work design matrix for one step (a mapping of STEP_COLUMNS)."""
    n = f["num_prefill_tokens"] + f["num_decode_tokens"]
    graph = bool(f["graph"])
    mixed = n if f["num_prefill_tokens"] else 0
    row = hats(layout.rows(n, graph, bool(mixed)), layout.token_knots)
    b = f["num_decode_seqs"]
    ctx = f["decode_context_tokens"]
    if FORMS[form]:
        row += [ctx * w for w in hats(math.log2(max(b, 1)), LOG_BATCH_KNOTS, False)]
    else:
        row.append(ctx)
    row += [layout.decode_tail_tokens(b, f["decode_max_context"], ctx, graph, block_size, mixed,
                                      f.get("decode_contexts")),
            f["prefill_attention_pairs"], f["prefill_context_tokens"],
            layout.prefill_tail_tokens(f.get("prefill_chunks")),
            f["num_decode_seqs"] + f["num_prefill_seqs"],
            float(b) if graph and mixed else 0.0,
            1.0 if graph and mixed else 0.0,
            float(layout.rows(n, graph, True)) if mixed else 0.0,
            0.0 if graph else 1.0]
    return row


def coef_names(form: str, token_knots) -> list:
    names = [f"t_linear_s@{k}" for k in token_knots]
    names += [f"a_decode_s_per_token@b{k}" for k in BATCH_KNOTS] if FORMS[form] \
        else ["a_decode_s_per_token"]
    return names + ["a_decode_longest_s_per_token", "a_prefill_s_per_pair",
                    "a_prefill_ctx_s_per_token", "a_prefill_tail_s_per_token", "c_seq_s",
                    "c_mixed_seq_s", "c_mixed_s", "c_prefill_row_s", "c_eager_s",
                    "host_floor_s",
                    "host_floor_s_per_seq"]


def pack_step_coefs(c, h, form: str, token_knots) -> dict:
    """Coefficient vectors (device work, host floor) -> the auditable dict in fit.json."""
    k = len(token_knots)
    c = np.asarray(c, float).copy()
    c[:k] = np.cumsum(c[:k])           # increments -> T_lin at each knot
    c = [_round(float(v)) for v in c]
    j = k + (len(BATCH_KNOTS) if FORMS[form] else 1)
    return {"t_linear_s": c[:k], "a_decode_s_per_token": c[k:j],
            "a_decode_longest_s_per_token": c[j],
            "a_prefill_s_per_pair": c[j + 1], "a_prefill_ctx_s_per_token": c[j + 2],
            "a_prefill_tail_s_per_token": c[j + 3],
            "c_seq_s": c[j + 4], "c_mixed_seq_s": c[j + 5], "c_mixed_s": c[j + 6],
            "c_prefill_row_s": c[j + 7], "c_eager_s": c[j + 8],
            "host_floor_s": _round(float(h[0])), "host_floor_s_per_seq": _round(float(h[1]))}


def _design(df: pd.DataFrame, form: str, layout: StepLayout, block_size: int) -> tuple:
    """(device-work matrix, host-floor matrix, eager mask) of a frame of steps."""
    columns = list(STEP_COLUMNS[2:-1]) + [c for c in ("decode_contexts", "prefill_chunks")
                                          if c in df]
    rows = df[columns].to_dict("records")
    x = np.array([feature_row(r, form, layout, block_size) for r in rows], float)
    # T_lin never falls as tokens grow: fit its non-negative increments between knots
    # (column i = the weight on knots i and above); pack_step_coefs sums them back.
    k = len(layout.token_knots)
    x[:, :k] = np.cumsum(x[:, :k][:, ::-1], axis=1)[:, ::-1]
    seqs = (df["num_decode_seqs"] + df["num_prefill_seqs"]).to_numpy(float)
    hx = np.column_stack([np.ones(len(df)), seqs])
    return x, hx, df["graph"].to_numpy() == 0


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


SHARED_TAIL = 5     # c_seq, c_mixed_seq, c_mixed, c_prefill_row, c_eager: the same for every
                    # block size (host work, padding)


def _joint_design(steps: pd.DataFrame, form: str, sharing: str, layout: StepLayout,
                  block_sizes: list) -> tuple:
    """Design matrices of all block sizes at once. With `sharing == "shared"` the linear-layer
    curve, the per-sequence, eager and host-floor terms are one set for every block size (they
    do not depend on it) and only the attention terms are per block size; otherwise every
    term is. Returns (x, hx, eager, rows of `steps` in order, fold, unpack) where
    unpack(c, h, i) gives block size i's (device-work, host-floor) coefficients."""
    k, nbs = len(layout.token_knots), len(block_sizes)
    parts = [_design(steps[steps["block_size"] == bs], form, layout, bs) for bs in block_sizes]
    p = parts[0][0].shape[1]
    m = p - k - SHARED_TAIL                     # attention columns
    xs, hxs = [], []
    for i, (x, hx, _) in enumerate(parts):
        if sharing == "shared":
            big = np.zeros((len(x), k + nbs * m + SHARED_TAIL))
            big[:, :k] = x[:, :k]
            big[:, k + i * m:k + (i + 1) * m] = x[:, k:k + m]
            big[:, -SHARED_TAIL:] = x[:, -SHARED_TAIL:]
            hbig = hx
        else:
            big = np.zeros((len(x), nbs * p))
            big[:, i * p:(i + 1) * p] = x
            hbig = np.zeros((len(x), 2 * nbs))
            hbig[:, 2 * i:2 * i + 2] = hx
        xs.append(big)
        hxs.append(hbig)
    rows = np.concatenate([np.flatnonzero((steps["block_size"] == bs).to_numpy())
                           for bs in block_sizes])
    fold = np.concatenate([np.arange(len(x)) % CV_FOLDS for x, _, _ in parts])

    def unpack(c, h, i):
        if sharing == "shared":
            return np.concatenate([c[:k], c[k + i * m:k + (i + 1) * m], c[-SHARED_TAIL:]]), h
        return c[i * p:(i + 1) * p], h[2 * i:2 * i + 2]

    return (np.vstack(xs), np.vstack(hxs), np.concatenate([e for _, _, e in parts]), rows,
            fold, unpack)


# ----------------------------------------------------------------------------------------------
# Transfers: swaps and block copies


def fit_transfer(df: pd.DataFrame) -> dict:
    """`time_s = c0_s + c_block_s * num_blocks + c_byte_s * bytes`, non-negative, relative LSQ."""
    x = np.column_stack([np.ones(len(df)), df["num_blocks"].to_numpy(float),
                         df["bytes"].to_numpy(float)])
    t = df["time_s"].to_numpy(float)
    c = solve_relative(x, t)
    out = {"c0_s": _round(c[0]), "c_block_s": _round(c[1]), "c_byte_s": _round(c[2])}
    pred = x @ np.array([out["c0_s"], out["c_block_s"], out["c_byte_s"]])
    big = df["bytes"].to_numpy(float) >= np.percentile(df["bytes"], 75)
    out["bandwidth_bytes_per_s"] = _round(float(np.median(df["bytes"][big] / df["time_s"][big])), 4)
    out["error"] = rel_error_summary(pred, t)
    return out


# ----------------------------------------------------------------------------------------------
# The fit


def fit_steps(steps: pd.DataFrame, meta: dict | None = None) -> dict:
    """Fit the step model of every block size; choose the form by cross-validation on the
    training rows (the held-out rows are never seen before the final error)."""
    steps = with_design_items(steps.reset_index(drop=True))
    held = holdout_mask(steps)
    layout = replace(layout_from_meta(meta or {}, int((steps["num_prefill_tokens"]
                                                       + steps["num_decode_tokens"]).max())),
                     decode_tail_in_order=True)
    token_knots = list(layout.token_knots)
    block_sizes = sorted(int(b) for b in steps["block_size"].unique())
    t_all = steps["time_s"].to_numpy(float)

    train = steps[~held].reset_index(drop=True)
    t_train = train["time_s"].to_numpy(float)
    cv = {}
    for form_sharing in FORM_SHARINGS:
        form, sharing = form_sharing.split("/")
        # the decode kernel's concurrent programs per SM: the best of DECODE_SLOTS by CV; one
        # design per slot count serves the candidates with and without the host floor
        for slots in DECODE_SLOTS:
            trial = replace(layout, decode_slots_per_sm=float(slots))
            x, hx, eager, rows, fold, _ = _joint_design(train, form, sharing, trial, block_sizes)
            for floor in FLOORS:
                name = form_sharing + floor
                errs = _cv_errors(x, hx, t_train[rows], eager, fold, bool(floor))
                score = {"median": round(float(np.median(errs)), 4),
                         "p95": round(float(np.percentile(errs, 95)), 4),
                         "rms": _rms(errs),
                         "decode_slots_per_sm": slots}
                rms_by_slots = cv[name]["rms_by_decode_slots"] if name in cv else {}
                rms_by_slots[str(slots)] = score["rms"]
                if name not in cv or score["rms"] < cv[name]["rms"]:
                    cv[name] = score
                cv[name]["rms_by_decode_slots"] = rms_by_slots
    # The simplest candidate whose CV RMS error is within 5% (relative) of the best one.
    best = min(v["rms"] for v in cv.values())
    chosen = next(n for n in CANDIDATES if _close_enough(cv[n]["rms"], best))
    form, sharing, *floor = chosen.split("/")
    layout = replace(layout, decode_slots_per_sm=float(cv[chosen]["decode_slots_per_sm"]))
    # Then the prefill kernel's concurrent programs per SM for that form (0: no prefill tail
    # term), by CV on the same folds: 0 unless another count is more than 5% better.
    rms_by_prefill = {}
    for slots in PREFILL_SLOTS:
        trial = replace(layout, prefill_slots_per_sm=float(slots))
        x, hx, eager, rows, fold, _ = _joint_design(train, form, sharing, trial, block_sizes)
        errs = _cv_errors(x, hx, t_train[rows], eager, fold, bool(floor))
        rms_by_prefill[slots] = _rms(errs)
    best_prefill = min(rms_by_prefill, key=lambda k: (rms_by_prefill[k], k))
    prefill_slots = 0 if _close_enough(rms_by_prefill[0], rms_by_prefill[best_prefill]) \
        else best_prefill
    layout = replace(layout, prefill_slots_per_sm=float(prefill_slots))

    x, hx, eager, rows, _, unpack = _joint_design(train, form, sharing, layout, block_sizes)
    c_all, h_all = _fit_rows(x, hx, t_train[rows], eager, bool(floor))
    per_bs = {}
    pred = np.empty(len(steps))
    regime = np.empty(len(steps), dtype=object)
    for i, bs in enumerate(block_sizes):
        coefs = pack_step_coefs(*unpack(c_all, h_all, i), form, token_knots)
        per_bs[str(bs)] = coefs
        no_floor = dict(coefs, host_floor_s=0.0, host_floor_s_per_seq=0.0)
        for j in np.flatnonzero((steps["block_size"] == bs).to_numpy()):
            row = steps.loc[j]
            pred[j] = predict_step(coefs, row, layout, bs)
            regime[j] = "graphed" if row["graph"] else (
                "eager_at_host_floor" if pred[j] > predict_step(no_floor, row, layout, bs)
                else "eager")

    def summary(mask):
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

    return {
        "form": form,
        "sharing": sharing,
        "host_floor": bool(floor),
        "block_sizes": block_sizes,
        "token_knots": token_knots,
        "batch_knots": list(BATCH_KNOTS) if FORMS[form] else [],
        "graph_batch_sizes": list(layout.graph_batch_sizes),
        "layout": layout.to_json(),
        "coefficient_names": coef_names(form, token_knots),
        "step": per_bs,
        "holdout": {"rule": HOLDOUT_RULE,
                    "ids": sorted(set(steps.loc[held, "id"].astype(str))),
                    "rows": int(held.sum())},
        "holdout_error": summary(held),
        "train_error": summary(~held),
        "form_selection": {"method": f"{CV_FOLDS}-fold cross-validation (fold = position in "
                                     f"the design % {CV_FOLDS}) on training rows only; per "
                                     "candidate the decode_slots_per_sm of DECODE_SLOTS with "
                                     "the smallest RMS, then the simplest candidate within 5% "
                                     "of the best RMS relative error (candidates simplest "
                                     "first; '/floor': with the eager steps' host floor); "
                                     "then, for it, the prefill_slots_per_sm of PREFILL_SLOTS "
                                     "with the smallest RMS unless 0 (no prefill tail) is "
                                     "within 5% of it",
                           "decode_slots_candidates": list(DECODE_SLOTS),
                           "prefill_slots_candidates": list(PREFILL_SLOTS),
                           "rms_by_prefill_slots": {str(k): v for k, v in
                                                    rms_by_prefill.items()},
                           "prefill_slots_per_sm": prefill_slots,
                           "candidates": list(CANDIDATES), "cv_error": cv, "chosen": chosen},
    }


RESTED_NOTE = ("median of rested_s / time_s per family (steps.csv's rested_s: each composition "
               "again after 0.1 s of idle); a diagnostic of the clock state, no model uses it")

ENGINE_COLUMNS = ("num_seqs", "num_prefill_tokens", "outside_s")


def rested_ratios(steps: pd.DataFrame) -> dict:
    """The profiler's optional `rested` part against the grid: the median of rested_s / time_s
    per family (rows without a positive, finite ratio left out, and counted)."""
    ratio = pd.to_numeric(steps["rested_s"], errors="coerce") / steps["time_s"]
    ok = np.isfinite(ratio) & (ratio > 0)
    median = {family: _round(float(part.median()), 4)
              for family, part in ratio[ok].groupby(steps.loc[ok, "family"])}
    return {"median_ratio": median, "rows": int(ok.sum()), "rows_left_out": int((~ok).sum()),
            "note": RESTED_NOTE}


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
    return {"c0_s": _round(float(c[0])), "c_seq_s": _round(float(c[1])),
            "c_prefill_token_s": _round(float(c[2])), "rows": int(len(df)),
            "mean_s": _round(float(t.mean())),
            "median_abs_error_s": _round(float(np.median(err))),
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


def fit_profile(profile_dir, out=None) -> dict:
    """Fit `profile_dir`'s raw CSVs; write `fit.json` into `out` (default: `profile_dir`).

    Returns the fit as a dict (the content of fit.json). Deterministic: refitting the same CSVs
    gives the same file (coefficients rounded to 6 significant digits, errors to 4 decimals).
    """
    profile_dir = Path(profile_dir)
    if not profile_dir.is_dir():
        raise InputError(f"{profile_dir}: not a directory (give a profile directory written by "
                         "`simkv profile`)")
    meta = read_meta(profile_dir)
    steps = read_csv(profile_dir / "steps.csv", STEP_COLUMNS)
    if steps.empty:
        raise InputError(f"{profile_dir / 'steps.csv'}: no rows")
    fit = {"format": FIT_FORMAT,
           "gpu": meta.get("gpu", profile_dir.parent.name),
           "model": meta.get("model", profile_dir.name),
           "dtype": meta.get("dtype", "bfloat16"),
           "kv_dtype": meta.get("kv_dtype", "bf16"),
           "formula": ("G = T_lin(N_eff) + a_dec(B) * decode_context_tokens + a_long * "
                       "decode_tail_tokens + a_pf * "
                       "prefill_attention_pairs + a_ctx * prefill_context_tokens + a_ptail * "
                       "prefill_tail_tokens + c_seq * "
                       "num_seqs + c_prefill_row * N_eff * [prefill chunks] + (c_mixed + "
                       "c_mixed_seq * num_decode_seqs) * [graphed mixed] + c_eager * [eager]; "
                       "graphed step: t = G; eager step: "
                       "t = max(G, host_floor + host_floor_per_seq * num_seqs) (host_floor "
                       "0 when the chosen form has none: t = G); decode_tail_tokens: the "
                       "decode programs list-scheduled in batch order; plus copies "
                       "and swaps: c0 + c_block * blocks + c_byte * bytes"),
           "units": "seconds; token counts; pairs = causal query-key pairs",
           "source": {"dir": profile_dir.name, "steps_rows": int(len(steps)),
                      "profiled": meta.get("date"), "command": meta.get("command")}}
    fit.update(fit_steps(steps, meta))
    if "rested_s" in steps.columns:
        fit["rested_vs_grid"] = rested_ratios(steps)
    for key in ("model_shape", "kv_bytes_per_token"):
        if key in meta:
            fit[key] = meta[key]
    engine_path = profile_dir / "engine_host.csv"
    if engine_path.is_file():
        fit["engine_host"] = fit_engine_host(read_csv(engine_path, ENGINE_COLUMNS))
    serving_path = profile_dir / "serving_host.csv"
    if serving_path.is_file():
        serving = read_csv(serving_path, SERVING_COLUMNS)
        try:
            fit["serving_host"] = fit_serving_host(serving, steps)
        except InputError as e:
            raise InputError(f"{profile_dir}/{e}") from None
    for name in ("swap", "copy"):
        path = profile_dir / f"{name}.csv"
        if not path.is_file():
            continue
        df = read_csv(path, TRANSFER_COLUMNS + (("direction",) if name == "swap" else ()))
        if name == "swap":
            fit["swap"] = {d: fit_transfer(df[df["direction"] == d])
                           for d in ("out", "in") if (df["direction"] == d).any()}
        elif len(df):
            fit["copy"] = fit_transfer(df)
    out_dir = Path(out) if out is not None else profile_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fit.json").write_text(json.dumps(fit, indent=1) + "\n")
    return fit
