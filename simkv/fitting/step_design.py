"""The step fit's design matrices: one row of features per profiled step, for every block size
at once, in the terms of the formula in `simkv.fitting.fit`'s docstring."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simkv.costmodel.step_formula import BATCH_KNOTS, FORMS, LOG_BATCH_KNOTS, StepLayout, hats
from simkv.fitting.numerics import round_sig

STEP_COLUMNS = (
    "id", "family", "block_size", "num_prefill_tokens", "num_decode_tokens", "num_prefill_seqs",
    "num_decode_seqs", "decode_context_tokens", "prefill_context_tokens",
    "prefill_attention_pairs", "decode_max_context", "graph", "time_s",
)
CV_FOLDS = 5                # a row's fold: its position among its block size's rows % CV_FOLDS
SHARED_TAIL = 5     # c_seq, c_mixed_seq, c_mixed, c_prefill_row, c_eager: the same for every
                    # block size (host work, padding); a MoE model's a_expert after them


def shared_tail(layout: StepLayout) -> int:
    """Columns at the end of a row that every block size shares: SHARED_TAIL, and the experts'
    column of a MoE model (expert weights read do not depend on the block size)."""
    return SHARED_TAIL + (1 if layout.has_experts else 0)


def with_design_items(steps: pd.DataFrame, layout: StepLayout | None = None) -> pd.DataFrame:
    """`steps` with a `decode_contexts` column: each row's decode context lengths in batch order,
    from the profiler's design by id, kept only where they agree with the row's own features
    (count, total and longest context); None otherwise (an id the design does not have, or a
    composition changed under its id): the tail then takes the longest sequence first. And a
    `prefill_chunks` column: the row's (cached prefix, tokens) chunks from the design, kept where
    they agree with its prefill tokens and context (None: no prefill tail for the row)."""
    from simkv.profile.design import decode_contexts_by_id, prefill_chunks_by_id
    window = layout.sliding_window if layout is not None else 0
    experts = (layout.num_experts, layout.experts_top_k) \
        if layout is not None and layout.has_experts else ()
    lookup = decode_contexts_by_id(window, experts)    # a model's window/expert compositions too
    chunk_lookup = prefill_chunks_by_id(window, experts)
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
            layout.prefill_tail_tokens(f.get("prefill_chunks"))]
    if layout.has_window:        # the sliding layers' reads and pairs, bounded by the window
        row += [layout.window_decode_tokens(b, ctx, f.get("decode_contexts")) if b else 0.0,
                layout.window_prefill_pairs(f.get("prefill_chunks"),
                                            f["prefill_attention_pairs"])
                if f["num_prefill_tokens"] else 0.0]
    row += [f["num_decode_seqs"] + f["num_prefill_seqs"],
            float(b) if graph and mixed else 0.0,
            1.0 if graph and mixed else 0.0,
            float(layout.rows(n, graph, True)) if mixed else 0.0,
            0.0 if graph else 1.0]
    if layout.has_experts:
        row.append(layout.experts_touched(n, layout.rows(n, graph, bool(mixed))))
    return row


WINDOW_KEYS = ("a_window_decode_s_per_token", "a_window_prefill_s_per_pair")
EXPERT_KEY = "a_expert_s"


def _scalar_keys(layout: StepLayout | None) -> list:
    """The scalar device-work coefficients after T_lin and a_decode, in column order."""
    keys = ["a_decode_longest_s_per_token", "a_prefill_s_per_pair", "a_prefill_ctx_s_per_token",
            "a_prefill_tail_s_per_token"]
    if layout is not None and layout.has_window:
        keys += list(WINDOW_KEYS)
    keys += ["c_seq_s", "c_mixed_seq_s", "c_mixed_s", "c_prefill_row_s", "c_eager_s"]
    if layout is not None and layout.has_experts:
        keys.append(EXPERT_KEY)
    return keys


def coef_names(form: str, token_knots, layout: StepLayout | None = None) -> list:
    names = [f"t_linear_s@{k}" for k in token_knots]
    names += [f"a_decode_s_per_token@b{k}" for k in BATCH_KNOTS] if FORMS[form] \
        else ["a_decode_s_per_token"]
    return names + _scalar_keys(layout) + ["host_floor_s", "host_floor_s_per_seq"]


def pack_step_coefs(c, h, form: str, token_knots, layout: StepLayout | None = None) -> dict:
    """Coefficient vectors (device work, host floor) -> the auditable dict in fit.json."""
    k = len(token_knots)
    c = np.asarray(c, float).copy()
    c[:k] = np.cumsum(c[:k])           # increments -> T_lin at each knot
    c = [round_sig(float(v)) for v in c]
    j = k + (len(BATCH_KNOTS) if FORMS[form] else 1)
    out = {"t_linear_s": c[:k], "a_decode_s_per_token": c[k:j]}
    out.update(zip(_scalar_keys(layout), c[j:]))
    out.update(host_floor_s=round_sig(float(h[0])), host_floor_s_per_seq=round_sig(float(h[1])))
    return out


def design_matrix(df: pd.DataFrame, form: str, layout: StepLayout, block_size: int) -> tuple:
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



def joint_design(steps: pd.DataFrame, form: str, sharing: str, layout: StepLayout,
                  block_sizes: list) -> tuple:
    """Design matrices of all block sizes at once. With `sharing == "shared"` the linear-layer
    curve, the per-sequence, eager and host-floor terms are one set for every block size (they
    do not depend on it) and only the attention terms are per block size; otherwise every
    term is. Returns (x, hx, eager, rows of `steps` in order, fold, unpack) where
    unpack(c, h, i) gives block size i's (device-work, host-floor) coefficients."""
    k, nbs = len(layout.token_knots), len(block_sizes)
    parts = [design_matrix(steps[steps["block_size"] == bs], form, layout, bs)
             for bs in block_sizes]
    p = parts[0][0].shape[1]
    tail = shared_tail(layout)
    m = p - k - tail                     # attention columns
    xs, hxs = [], []
    for i, (x, hx, _) in enumerate(parts):
        if sharing == "shared":
            big = np.zeros((len(x), k + nbs * m + tail))
            big[:, :k] = x[:, :k]
            big[:, k + i * m:k + (i + 1) * m] = x[:, k:k + m]
            big[:, -tail:] = x[:, -tail:]
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
            return np.concatenate([c[:k], c[k + i * m:k + (i + 1) * m], c[-tail:]]), h
        return c[i * p:(i + 1) * p], h[2 * i:2 * i + 2]

    return (np.vstack(xs), np.vstack(hxs), np.concatenate([e for _, _, e in parts]), rows,
            fold, unpack)
