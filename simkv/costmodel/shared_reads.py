"""Decode reads of KV blocks that several sequences of a batch share.

    python -m simkv.costmodel.shared_reads PROBE_DIR [PROBE_DIR...] \
        --profile profiles/h200/llama-3.1-8b

A profile's block tables never share a block, so its decode-attention term charges every
context token as a read from HBM. In serving, n > 1 samples share their prompt's blocks and
prefix caching shares common prefixes; the decode kernel's programs for those sequences read the
same blocks at about the same time, and the repeats come from L2. `benchmarks/shared_blocks.py`
times decode batches with and without such sharing (H200, 2026-11-29: 7-25% faster steps); this
fits the share of a read from HBM that each repeated read saves:

    saving(b, ctx, g) = t(unshared) - t(shared) = s * a_dec(b) * repeated_tokens

with a_dec(b) the profile's per-token decode cost at batch b and repeated_tokens the repeated
reads: (holders - 1) x block_size summed over the blocks several tables of the batch hold (the
members of a group sit next to each other in the batch, as the scheduler places a request's
samples). Only the adjacent groups are fitted; groups spread over the batch are reported apart
(pairs half a batch apart lose most of the saving: the model does not see placement).

The result goes to `shared_reads.json` beside the profile's fit.json; the profiled model then
charges decode reads as `decode_context_tokens - s * decode_shared_context_tokens` (the
scheduler counts the latter from the KV manager's references beyond the first, less the shares
of the running tables outside the step's decodes).
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

SHARED_READS_FILE = "shared_reads.json"
SHARED_READS_FORMAT = "simkv-shared-reads-1"
OWN_TOKENS = 64           # each probe sequence's unshared tail (benchmarks/shared_blocks.py)


def load_shared_reads(profile_dir: Path) -> dict | None:
    """{'saving': s, ...} from the profile's shared_reads.json, or None when it has none."""
    path = Path(profile_dir) / SHARED_READS_FILE
    if not path.is_file():
        return None
    data = read_json_object(path, "run `python -m simkv.costmodel.shared_reads`")
    saving = data.get("saving")
    if data.get("format") != SHARED_READS_FORMAT or isinstance(saving, bool) \
            or not isinstance(saving, (int, float)) or not math.isfinite(saving) \
            or not 0 <= saving <= 1:
        raise InputError(f"{path}: needs format {SHARED_READS_FORMAT} and a saving in [0, 1] "
                         "(re-run `python -m simkv.costmodel.shared_reads`)")
    return {"saving": float(saving), "path": str(path)}


def repeated_tokens(batch: int, context: int, group: int, block_size: int) -> int:
    """Context tokens in blocks another sequence of the probe's batch holds too."""
    if group <= 1:
        return 0
    shared_blocks = (context - OWN_TOKENS) // block_size
    return (batch - batch // group) * shared_blocks * block_size


def fit_shared_reads(probe_dirs, profile_dir: Path) -> dict:
    """The saving per repeated read (least squares through 0 on the adjacent groups of one or
    more probes, each against its own unshared batches)."""
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
    med["full_read_s"] = [models[bs].decode_token_seconds(int(b)) * repeated_tokens(
        int(b), int(c), int(g), int(bs)) for bs, b, c, g in
        zip(med["block_size"], med["batch"], med["context"], med["group"])]
    adjacent = ~med["spread"].astype(bool)
    x, y = med.loc[adjacent, "full_read_s"], med.loc[adjacent, "saving_s"]
    saving = float(np.clip(np.dot(x, y) / np.dot(x, x), 0.0, 1.0))
    med["predicted_saving_s"] = saving * med["full_read_s"]
    med["step_error"] = (med["time_s"] + med["saving_s"] - med["predicted_saving_s"]) \
        / med["time_s"] - 1
    cases = [{"probe": r.probe, "batch": int(r.batch), "context": int(r.context),
              "group": int(r.group), "spread": bool(r.spread), "time_ms": round(1e3 * r.time_s, 3),
              "saving_ms": round(1e3 * r.saving_s, 3),
              "predicted_saving_ms": round(1e3 * r.predicted_saving_s, 3),
              "step_error": round(float(r.step_error), 4)} for r in med.itertuples()]
    err = med["step_error"].abs()
    return {
        "format": SHARED_READS_FORMAT,
        "saving": round(saving, 4),
        "fit": {"probes": [str(p) for p in probe_dirs], "profile": str(profile_dir),
                "adjacent_cases": int(adjacent.sum()),
                "adjacent_max_abs_step_error": round(float(err[adjacent].max()), 4),
                "spread_max_abs_step_error": round(float(err[~adjacent].max()), 4)
                if (~adjacent).any() else None},
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
    print(json.dumps({"saving": result["saving"], **result["fit"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
