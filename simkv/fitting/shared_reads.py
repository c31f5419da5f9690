"""Fit the saving of decode reads of KV blocks that several sequences of a batch share.

    python -m simkv.fitting.shared_reads PROBE_DIR [PROBE_DIR...] \
        --profile profiles/h200/llama-3.1-8b

A profile's block tables never share a block, so its decode-attention term charges every
context token as a read from HBM. In serving, n > 1 samples share their prompt's blocks and
prefix caching shares common prefixes; the decode kernel's programs for those sequences read the
same blocks at about the same time, and the repeats come from L2. `research/shared_blocks.py`
times decode batches with and without such sharing; this fits the share of a read from HBM that
a repeated read saves, the first repeat of a block apart from the further ones:

    saving(b, ctx, g) = t(unshared) - t(shared)
        = a_dec(b) * (s_first * first_tokens + s_further * (repeated_tokens - first_tokens))

with a_dec(b) the profile's per-token decode cost at batch b, repeated_tokens the repeated reads:
(holders - 1) x block_size summed over the blocks several tables of the batch hold, and
first_tokens their first repeats: block_size x those blocks (repeated_tokens / (g - 1) for groups
of g). The first repeat is fitted apart because a pair's repeat saves more than each repeat
within a group of 8 or 64; the one saving for every repeat is fitted and reported beside it
(`fit.single_saving`). The fitted shares and their errors are in the profile's
shared_reads.json and docs/validation.md.

The members of a group sit next to each other in the batch, as the scheduler places a request's
samples. Only the adjacent groups are fitted; groups spread over the batch are reported apart
(pairs half a batch apart lose most of the saving: the model does not see placement).

The result goes to `shared_reads.json` beside the profile's fit.json: `saving_first`,
`saving_further` and `saving` (the one saving), which `simkv.costmodel.shared_reads` loads.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.costmodel.profiled import ProfiledCostModel
from simkv.costmodel.shared_reads import first_repeat_tokens, repeated_tokens
from simkv.errors import InputError
from simkv.profile.format import SHARED_READS_FILE, SHARED_READS_FORMAT

CASE_FIELDS = {           # what each case in shared_reads.json says
    "time_ms": "median step time of the shared batch",
    "saving_ms": "median step time of the unshared batch of the same size and context, less "
                 "time_ms",
    "predicted_saving_ms": "a_dec(batch) x (saving_first x first-repeat tokens + saving_further "
                           "x further-repeat tokens)",
    "step_error": "(unshared time - predicted_saving_ms) / time_ms - 1: the predicted step "
                  "time's error",
}


def _step_errors(med, predicted_s):
    """Each case's step error when its saving is `predicted_s`: predicted shared step time
    (unshared time less the prediction) over the measured one, less 1."""
    return (med["time_s"] + med["saving_s"] - predicted_s) / med["time_s"] - 1


def _median_savings(probe_dirs: list) -> pd.DataFrame:
    """The shared cases of the probes: median `time_s` per (probe, block size, batch, context,
    group, spread), and `saving_s`, the median unshared batch of the same size and context less
    it."""
    parts = []
    for probe_dir in map(Path, probe_dirs):
        try:
            steps = pd.read_csv(probe_dir / "steps.csv")
        except (OSError, ValueError) as e:
            raise InputError(f"{probe_dir}: not a shared-blocks probe "
                             f"({' '.join(str(e).split())})") from None
        need = {"batch", "context", "group", "spread", "time_s"}
        if not need <= set(steps.columns):
            raise InputError(f"{probe_dir}/steps.csv: needs columns {sorted(need)}")
        if "block_size" not in steps:
            steps["block_size"] = 16
        steps["probe"] = str(probe_dir)
        parts.append(steps)
    keys = ["probe", "block_size", "batch", "context", "group", "spread"]
    med = pd.concat(parts).groupby(keys)["time_s"].median().reset_index()
    base = med[med["group"] == 1].set_index(["probe", "block_size", "batch", "context"])["time_s"]
    med = med[med["group"] > 1].copy()
    keys = list(zip(med["probe"], med["block_size"], med["batch"], med["context"]))
    missing = sorted({k for k in keys if k not in base.index})
    if missing:
        raise InputError(f"{missing[0][0]}/steps.csv: no unshared batch (group 1) of batch "
                         f"{missing[0][2]}, context {missing[0][3]} to measure the saving against")
    med["saving_s"] = [base[k] for k in keys] - med["time_s"]
    return med


def _read_seconds(med: pd.DataFrame, profile_dir: Path) -> tuple:
    """(full, first): each case's seconds to read its repeats (their first ones) from HBM at
    the profile's per-token decode cost."""
    models = {bs: ProfiledCostModel.load(profile_dir, block_size=int(bs))
              for bs in set(med["block_size"])}
    full, first = [], []
    for bs, b, c, g in zip(med["block_size"], med["batch"], med["context"], med["group"]):
        a_dec = models[bs].decode_token_seconds(int(b))
        full.append(a_dec * repeated_tokens(int(b), int(c), int(g), int(bs)))
        first.append(a_dec * first_repeat_tokens(int(b), int(c), int(g), int(bs)))
    return full, first


def _fit_savings(med: pd.DataFrame, adjacent) -> tuple:
    """(saving, saving_first, saving_further) by least squares through 0 on the adjacent
    cases, each clipped to [0, 1]."""
    x, y = med.loc[adjacent, "full_read_s"], med.loc[adjacent, "saving_s"]
    saving = float(np.clip(np.dot(x, y) / np.dot(x, x), 0.0, 1.0))
    first = med.loc[adjacent, "first_read_s"]
    two = np.column_stack([first, x - first])
    if np.linalg.matrix_rank(two) == 2:
        saving_first, saving_further = np.clip(np.linalg.lstsq(two, y, rcond=None)[0], 0, 1)
    else:      # one group size (or pairs only): the first repeats are not told apart
        saving_first = saving_further = saving
    return saving, saving_first, saving_further


def _errors(step_error, adjacent) -> dict:
    """The largest and RMS step error of the adjacent cases, the largest of the spread ones."""
    err = step_error.abs()
    return {"adjacent_max_abs_step_error": round(float(err[adjacent].max()), 4),
            "adjacent_rms_step_error": round(float(np.sqrt((err[adjacent] ** 2).mean())), 4),
            "spread_max_abs_step_error": round(float(err[~adjacent].max()), 4)
            if (~adjacent).any() else None}


def fit_shared_reads(probe_dirs, profile_dir: Path) -> dict:
    """The savings of repeated reads as shares of a read from HBM, by least squares through 0
    on the adjacent groups of one or more probes, each against its own unshared batches: one
    saving for every repeat (`saving`), and the first repeat of each block apart from the
    further ones (`saving_first`, `saving_further`); each clipped to [0, 1]. The cases and
    `fit`'s step errors are the two savings' (`fit['single_saving']`: the one saving's)."""
    if isinstance(probe_dirs, (str, Path)):
        probe_dirs = [probe_dirs]
    med = _median_savings(probe_dirs)
    med["full_read_s"], med["first_read_s"] = _read_seconds(med, profile_dir)
    adjacent = ~med["spread"].astype(bool)
    saving, saving_first, saving_further = _fit_savings(med, adjacent)
    med["predicted_saving_s"] = saving_first * med["first_read_s"] \
        + saving_further * (med["full_read_s"] - med["first_read_s"])
    med["step_error"] = _step_errors(med, med["predicted_saving_s"])
    cases = [{"probe": r.probe, "batch": int(r.batch), "context": int(r.context),
              "group": int(r.group), "spread": bool(r.spread), "time_ms": round(1e3 * r.time_s, 3),
              "saving_ms": round(1e3 * r.saving_s, 3),
              "predicted_saving_ms": round(1e3 * r.predicted_saving_s, 3),
              "step_error": round(float(r.step_error), 4)} for r in med.itertuples()]
    return {
        "format": SHARED_READS_FORMAT,
        "saving": round(saving, 4),
        "saving_first": round(float(saving_first), 4),
        "saving_further": round(float(saving_further), 4),
        "fit": {"probes": [str(p) for p in probe_dirs], "profile": str(profile_dir),
                "adjacent_cases": int(adjacent.sum()),
                **_errors(med["step_error"], adjacent),
                "single_saving": _errors(_step_errors(med, saving * med["full_read_s"]),
                                         adjacent)},
        "case_fields": CASE_FIELDS,
        "cases": cases,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe_dirs", type=Path, nargs="+", help="shared-blocks probe folders")
    ap.add_argument("--profile", type=Path, required=True, help="profile directory (fit.json)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"default: PROFILE/{SHARED_READS_FILE}")
    args = ap.parse_args(argv)
    try:
        result = fit_shared_reads(args.probe_dirs, args.profile)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or args.profile / SHARED_READS_FILE
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({key: result[key] for key in ("saving", "saving_first", "saving_further")}
                     | result["fit"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
