"""Do decode steps run faster when sequences of the batch share KV blocks?

    python research/shared_blocks.py [--model llama-3.1-8b] --out DIR     # GPU (no simpy), ~1 min

The validation runs whose decode steps the profiled model over-predicts even with the clock
state modelled are the ones whose batches share blocks: n = 2 samples share their prompt's
blocks (the bursty workload) and prefix caching shares a trace's common prefixes (Mooncake),
while the profile's block tables never share a block. Blocks that several programs of the
decode kernel read at about the same time can come from the L2 cache rather than HBM.

This times decode batches (back to back, after 0.2 s idle: the clock of light work) with the
same batch size and contexts under different sharing: none; groups of g sequences whose tables
share all but their last 64 tokens' blocks, the group's members next to each other in the batch
(as forked samples are) or spread over it; and one prefix shared by the whole batch. Writes
steps.csv (one row per timed step) and prints the median time of each case relative to the
unshared batch of the same size and context.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simkv.costmodel.shared_reads import OWN_TOKENS  # noqa: E402  (each sequence's own tail)

BLOCK_SIZE = 16


def batch(b: int, ctx: int, group: int, spread: bool, perm, tokens):
    """A decode StepPlan of b sequences of context ctx; members of a group of `group` share
    their tables but for the last OWN_TOKENS tokens (group 1: nothing shared; group b: one
    prefix for all)."""
    from simkv.profile.design import step_plan
    shared_blocks = (ctx - OWN_TOKENS) // BLOCK_SIZE if group > 1 else 0
    total_blocks = -(-ctx // BLOCK_SIZE)
    num_groups = b // group
    it = iter(perm.tolist())
    prefixes = [[next(it) for _ in range(shared_blocks)] for _ in range(num_groups)]
    tables = [prefixes[i % num_groups if spread else i // group]
              + [next(it) for _ in range(total_blocks - shared_blocks)] for i in range(b)]
    return step_plan([(ctx - 1, 1, True)] * b, BLOCK_SIZE, tables, tokens)


def main() -> None:
    import pandas as pd
    from _probe import probe_executor, probe_parser
    args = probe_parser(__doc__).parse_args()
    out, rng, ex, tokens = probe_executor(args, BLOCK_SIZE)
    cases = {}
    for b, ctx in ((64, 1024), (64, 4096), (128, 2048), (256, 1024)):
        for group, spread in ((1, False), (2, False), (2, True), (8, False), (8, True),
                              (b, False)):
            cases[(b, ctx, group, spread)] = batch(b, ctx, group, spread,
                                                   rng.permutation(ex.num_blocks), tokens)
    for plan in cases.values():
        ex.execute(plan)
    rows = []
    for order in (list(cases), list(reversed(list(cases)))):
        for key in order:
            time.sleep(0.2)
            for _ in range(3):
                ex.execute(cases[key])
            for rep in range(args.reps):
                ex.execute(cases[key])
                b, ctx, group, spread = key
                rows.append({"batch": b, "context": ctx, "group": group, "spread": spread,
                             "block_size": BLOCK_SIZE,
                             "rep": rep, "time_s": ex.last_gpu_s})
        pd.DataFrame(rows).to_csv(out / "steps.csv", index=False)
    df = pd.DataFrame(rows)
    med = df.groupby(["batch", "context", "group", "spread"])["time_s"].median().reset_index()
    base = med[med["group"] == 1].set_index(["batch", "context"])["time_s"]
    med["ms"] = 1e3 * med["time_s"]
    med["vs_unshared_%"] = 100 * (med["time_s"] / [base[(b, c)] for b, c in
                                                   zip(med["batch"], med["context"])] - 1)
    print(med.drop(columns="time_s").round(2).to_string(index=False))


if __name__ == "__main__":
    main()
