"""Decode reads of KV blocks that several sequences of a batch share: the fitted savings.

In serving, n > 1 samples share their prompt's blocks and prefix caching shares common
prefixes; the decode kernel's programs for those sequences read the same blocks at about the
same time, and the repeats come from L2 instead of HBM. `shared_reads.json`, beside a profile's
fit.json, gives the share of a read from HBM that a repeated read saves: `saving_first` for the
first repeat of a block, `saving_further` for each further one, `saving` for every repeat alike
(fitted by `simkv fit shared-reads`). The profiled model charges decode reads as
`decode_context_tokens - s_first * decode_shared_block_tokens - s_further *
(decode_shared_context_tokens - decode_shared_block_tokens)` (the scheduler counts both from the
KV manager's references beyond the first and its shared blocks, less the shares of the running
tables outside the step's decodes).

`repeated_tokens` and `first_repeat_tokens` count those tokens in a shared-blocks probe's batch
(`research/shared_blocks.py`: groups of sequences sharing all but their own OWN_TOKENS).
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from simkv.errors import InputError, read_json_object
from simkv.profile.format import SHARED_READS_FILE, SHARED_READS_FORMAT

OWN_TOKENS = 64           # each probe sequence's unshared tail (research/shared_blocks.py)


def _is_share(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and 0 <= value <= 1


def load_shared_reads(profile_dir: Path) -> dict | None:
    """{'saving', 'saving_first', 'saving_further', 'path'} from the profile's shared_reads.json
    (shares of a read from HBM: the one saving fitted for every repeat alike, which the model
    does not use, the first repeat of a block, each further one), or None when it has none."""
    path = Path(profile_dir) / SHARED_READS_FILE
    if not path.is_file():
        return None
    data = read_json_object(path, "run `simkv fit shared-reads`")
    saving, first, further = (data.get(k) for k in ("saving", "saving_first", "saving_further"))
    if data.get("format") != SHARED_READS_FORMAT or not all(map(_is_share,
                                                                (saving, first, further))):
        raise InputError(f"{path}: needs format {SHARED_READS_FORMAT} and saving, saving_first "
                         "and saving_further in [0, 1] (re-run `simkv fit shared-reads`)")
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


if __name__ == "__main__":
    print("renamed: python -m simkv.fitting.shared_reads", file=sys.stderr)
    from simkv.fitting.shared_reads import main
    sys.exit(main())
