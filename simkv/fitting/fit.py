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

The fit is split by concept: `step` (the step-time fit and its form selection), `step_design`
(its design matrices), `host` (engine and serving host terms), `transfers` (copies and swaps),
`numerics` (NNLS, relative-error fits) and `profile` (reading a profile folder, writing
fit.json). This module keeps their public names importable from one place.
"""
from __future__ import annotations

# Re-exports: `from simkv.fitting.fit import fit_profile` and the rest keep working.
from simkv.costmodel.step_formula import StepLayout, hats, predict_step
from simkv.fitting.host import (ENGINE_COLUMNS, SERVING_BLOCK_SIZE, SERVING_COLUMNS,
                                SERVING_TRIM_QUANTILE, SERVING_WARMUP_STEPS, fit_engine_host,
                                fit_serving_host)
from simkv.fitting.numerics import (SIG_DIGITS, nnls, rel_error_summary,
                                    solve_relative)
from simkv.fitting.profile import (FIT_FORMULA, RESTED_NOTE, fit_profile,
                                   read_csv, read_meta, rested_ratios)
from simkv.fitting.step import (CANDIDATES, DECODE_SLOTS, FLOORS, FORM_SHARINGS,
                                HOLDOUT_EVERY, HOLDOUT_MIXED_ROW, HOLDOUT_RULE, PREFILL_SLOTS,
                                fit_steps, holdout_mask)
from simkv.fitting.step_design import (CV_FOLDS, STEP_COLUMNS, coef_names,
                                       feature_row, pack_step_coefs, with_design_items)
from simkv.fitting.transfers import TRANSFER_COLUMNS, fit_transfer

__all__ = ["StepLayout", "hats", "predict_step", "ENGINE_COLUMNS", "SERVING_BLOCK_SIZE",
           "SERVING_COLUMNS", "SERVING_TRIM_QUANTILE", "SERVING_WARMUP_STEPS", "fit_engine_host",
           "fit_serving_host", "SIG_DIGITS", "nnls", "rel_error_summary", "solve_relative",
           "FIT_FORMULA", "RESTED_NOTE", "fit_profile", "read_csv", "read_meta", "rested_ratios",
           "CANDIDATES", "DECODE_SLOTS", "FLOORS", "FORM_SHARINGS", "HOLDOUT_EVERY",
           "HOLDOUT_MIXED_ROW", "HOLDOUT_RULE", "PREFILL_SLOTS", "fit_steps", "holdout_mask",
           "CV_FOLDS", "STEP_COLUMNS", "coef_names", "feature_row", "pack_step_coefs",
           "with_design_items", "TRANSFER_COLUMNS", "fit_transfer"]
