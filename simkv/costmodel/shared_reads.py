"""Decode reads of KV blocks that several sequences of a batch share.

    python -m simkv.costmodel.shared_reads PROBE_DIR [PROBE_DIR...] \
        --profile profiles/h200/llama-3.1-8b

A profile's block tables never share a block, so its decode-attention term charges every
context token as a read from HBM. In serving, n > 1 samples share their prompt's blocks and
prefix caching shares common prefixes; the decode kernel's programs for those sequences read the
same blocks at about the same time, and the repeats come from L2. `benchmarks/shared_blocks.py`
times decode batches with and without such sharing (H200, 2026-11-29: 7-25% faster steps); this
fits the share of a read from HBM that a repeated read saves, the first repeat of a block apart
from the further ones:

    saving(b, ctx, g) = t(unshared) - t(shared)
        = a_dec(b) * (s_first * first_tokens + s_further * (repeated_tokens - first_tokens))

with a_dec(b) the profile's per-token decode cost at batch b, repeated_tokens the repeated reads:
(holders - 1) x block_size summed over the blocks several tables of the batch hold, and
first_tokens their first repeats: block_size x those blocks (repeated_tokens / (g - 1) for groups
of g). A pair's repeat saves more than each repeat within a group of 8 or 64: with one saving s
for every repeat the pairs' steps came out up to 9.5% too slow. On the bundled H200 probes
s_first = 0.6508 and s_further = 0.4564 (one saving: 0.4923); over the 24 adjacent cases the
largest step error drops from 9.5% to 5.5%, the RMS from 4.3% to 3.0% (the spread groups, not
fitted, from 11.1% to 14.5%: spread pairs save little, and pairs are now credited more).

The members of a group sit next to each other in the batch, as the scheduler places a request's
samples. Only the adjacent groups are fitted; groups spread over the batch are reported apart
(pairs half a batch apart lose most of the saving: the model does not see placement).

The result goes to `shared_reads.json` beside the profile's fit.json: `saving_first`,
`saving_further` and, for older readers, `saving` (the one-saving fit). The profiled model charges
decode reads as `decode_context_tokens - s_first * decode_shared_block_tokens - s_further *
(decode_shared_context_tokens - decode_shared_block_tokens)` (the scheduler counts both from the
KV manager's references beyond the first and its shared blocks, less the shares of the running
tables outside the step's decodes).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.errors import InputError, read_json_object
from simkv.profile.format import SHARED_READS_FILE, SHARED_READS_FORMAT

OWN_TOKENS = 64           # each probe sequence's unshared tail (benchmarks/shared_blocks.py)
CASE_FIELDS = {           # what each case in shared_reads.json says
    "time_ms": "median step time of the shared batch",
    "saving_ms": "median step time of the unshared batch of the same size and context, less "
                 "time_ms",
    "predicted_saving_ms": "a_dec(batch) x (saving_first x first-repeat tokens + saving_further "
                           "x further-repeat tokens)",
    "step_error": "(unshared time - predicted_saving_ms) / time_ms - 1: the predicted step "
                  "time's error",
}


def _is_share(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and 0 <= value <= 1


def load_shared_reads(profile_dir: Path) -> dict | None:
    """{'saving', 'saving_first', 'saving_further', 'path'} from the profile's shared_reads.json
    (shares of a read from HBM: one for every repeat, the first repeat of a block, each further
    one; a file without the last two gives `saving` for both), or None when it has none."""
    path = Path(profile_dir) / SHARED_READS_FILE
    if not path.is_file():
        return None
    data = read_json_object(path, "run `python -m simkv.costmodel.shared_reads`")
    saving = data.get("saving")
    first = data.get("saving_first", saving)
    further = data.get("saving_further", saving)
    if data.get("format") != SHARED_READS_FORMAT or not all(map(_is_share,
                                                                (saving, first, further))):
        raise InputError(f"{path}: needs format {SHARED_READS_FORMAT} and a saving in [0, 1] "
                         "(and saving_first, saving_further in [0, 1] where given; re-run "
                         "`python -m simkv.costmodel.shared_reads`)")
    return {"saving": float(saving), "saving_first": float(first),
            "saving_further": float(further), "path": str(path)}


def repeated_tokens(batch: int, context: int, group: int, block_size: int) -> int:
    """Context tokens in blocks another sequence of the probe's batch holds too."""
    if group <= 1:
        return 0
    shared_blocks = (context - OWN_TOKENS) // block_size
    return (batch - batch // group) * shared_blocks * block_size


def first_repeat_tokens(batch: int, context: int, group: int, block_size: int) -> int:
    """Of `repeated_tokens`, the first repeat of each shared block: one per group and block."""
    if group <= 1:
        return 0
    shared_blocks = (context - OWN_TOKENS) // block_size
    return batch // group * shared_blocks * block_size


def _step_errors(med, predicted_s):
    """Each case's step error when its saving is `predicted_s`: predicted shared step time
    (unshared time less the prediction) over the measured one, less 1."""
    return (med["time_s"] + med["saving_s"] - predicted_s) / med["time_s"] - 1


def fit_shared_reads(probe_dirs, profile_dir: Path) -> dict:
    """The savings of repeated reads as shares of a read from HBM, by least squares through 0
    on the adjacent groups of one or more probes, each against its own unshared batches: one
    saving for every repeat (`saving`), and the first repeat of each block apart from the
    further ones (`saving_first`, `saving_further`); each clipped to [0, 1]. The cases and
    `fit`'s step errors are the two savings' (`fit['single_saving']`: the one saving's)."""
    from simkv.costmodel.profiled import ProfiledCostModel
    if isinstance(probe_dirs, (str, Path)):
        probe_dirs = [probe_dirs]
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
    models = {bs: ProfiledCostModel.load(profile_dir, block_size=int(bs))
              for bs in set(med["block_size"])}
    full, first = [], []       # seconds to read the repeats (their first ones) from HBM
    for bs, b, c, g in zip(med["block_size"], med["batch"], med["context"], med["group"]):
        a_dec = models[bs].decode_token_seconds(int(b))
        full.append(a_dec * repeated_tokens(int(b), int(c), int(g), int(bs)))
        first.append(a_dec * first_repeat_tokens(int(b), int(c), int(g), int(bs)))
    med["full_read_s"], med["first_read_s"] = full, first
    adjacent = ~med["spread"].astype(bool)
    x, y = med.loc[adjacent, "full_read_s"], med.loc[adjacent, "saving_s"]
    saving = float(np.clip(np.dot(x, y) / np.dot(x, x), 0.0, 1.0))
    first = med.loc[adjacent, "first_read_s"]
    two = np.column_stack([first, x - first])
    if np.linalg.matrix_rank(two) == 2:
        saving_first, saving_further = np.clip(np.linalg.lstsq(two, y, rcond=None)[0], 0, 1)
    else:      # one group size (or pairs only): the first repeats are not told apart
        saving_first = saving_further = saving
    med["predicted_saving_s"] = saving_first * med["first_read_s"] \
        + saving_further * (med["full_read_s"] - med["first_read_s"])
    med["step_error"] = _step_errors(med, med["predicted_saving_s"])
    cases = [{"probe": r.probe, "batch": int(r.batch), "context": int(r.context),
              "group": int(r.group), "spread": bool(r.spread), "time_ms": round(1e3 * r.time_s, 3),
              "saving_ms": round(1e3 * r.saving_s, 3),
              "predicted_saving_ms": round(1e3 * r.predicted_saving_s, 3),
              "step_error": round(float(r.step_error), 4)} for r in med.itertuples()]

    def errors(step_error) -> dict:
        err = step_error.abs()
        return {"adjacent_max_abs_step_error": round(float(err[adjacent].max()), 4),
                "adjacent_rms_step_error": round(float(np.sqrt((err[adjacent] ** 2).mean())), 4),
                "spread_max_abs_step_error": round(float(err[~adjacent].max()), 4)
                if (~adjacent).any() else None}

    return {
        "format": SHARED_READS_FORMAT,
        "saving": round(saving, 4),
        "saving_first": round(float(saving_first), 4),
        "saving_further": round(float(saving_further), 4),
        "fit": {"probes": [str(p) for p in probe_dirs], "profile": str(profile_dir),
                "adjacent_cases": int(adjacent.sum()),
                **errors(med["step_error"]),
                "single_saving": errors(_step_errors(med, saving * med["full_read_s"]))},
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
