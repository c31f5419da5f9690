"""Why do served steps run faster than the profile predicts? Two candidate causes, separated.

    python research/serving_state.py [--model llama-3.1-8b] --out DIR     # GPU (no simpy), ~2 min

The validation runs of 2026-11-29 (fifth profile) ran decode steps 2-6% faster than the
profiled model predicts in real time, and long-context decode batches ~10% faster even when
saturated (docs/validation.md). Two differences between the profile and serving could do it:

- block-table layout: the profiler's block tables are random permutations of the pool, so a
  sequence's blocks are scattered; a serving engine's KV manager hands out free blocks in
  order, and 78-85% of consecutive table entries in the validation runs are adjacent blocks
  (replayed through the same KV manager);
- the GPU's clock: the profile interleaves every composition with all the others, so the GPU
  sits at its 700 W power cap (~1.64 GHz); lighter serving lets it run at up to 1.98 GHz.

For a few decode compositions (uniform and serving-like lognormal contexts) this times each
under the four combinations of {random, contiguous} block tables x {hot: each repetition right
after a heavy 8,192-token prefill step, cool: back to back after 0.3 s of idle}, with
nvidia-smi logging the SM clock and power every 100 ms (smi.csv). Writes steps.csv (one row per
timed repetition, with its wall-clock time) and prints the median time per composition and
condition, relative to the profile's condition (random, hot).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BLOCK_SIZE = 16
HEAVY = [(0, 8192, False)]


def compositions(rng) -> dict:
    """name -> items (start, num_tokens, is_decode)."""
    out = {}
    for b, ctx in ((16, 1024), (64, 1024), (256, 1024), (32, 8192), (128, 4096)):
        out[f"decode/b{b}/c{ctx}"] = [(ctx - 1, 1, True)] * b
    for b in (64, 128, 200):        # serving-like: lognormal around 1,000, heavy tail to 6,300
        ctx = np.clip(rng.lognormal(np.log(1000), 0.8, b), 64, 6300).astype(int)
        out[f"decode/lognormal/b{b}"] = [(int(c) - 1, 1, True) for c in ctx]
    return out


def main() -> None:
    import pandas as pd
    from _probe import probe_executor, probe_parser
    from simkv.gpu.host import nvidia_smi_log
    from simkv.gpu.profiler import _plan
    args = probe_parser(__doc__).parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with nvidia_smi_log(out / "smi.csv"):
        out, rng, ex, tokens = probe_executor(args, BLOCK_SIZE)
        comps = compositions(rng)
        need = max(sum(-(-(s + n) // BLOCK_SIZE) for s, n, _ in items) for items in comps.values())
        if need > ex.num_blocks:
            raise SystemExit(f"--num-blocks {ex.num_blocks}: the largest composition needs {need}")
        layouts = {"random": lambda: rng.permutation(ex.num_blocks),
                   "contiguous": lambda: np.arange(ex.num_blocks)}
        plans = {(name, lay): _plan(items, BLOCK_SIZE, make(), tokens)
                 for name, items in comps.items() for lay, make in layouts.items()}
        heavy = _plan(HEAVY, BLOCK_SIZE, rng.permutation(ex.num_blocks), tokens)
        for plan in list(plans.values()) + [heavy]:          # warm-up, graph checks
            ex.execute(plan)
        rows = []
        for state in ("hot", "cool", "hot", "cool"):           # each state twice, alternating
            for (name, lay), plan in plans.items():
                if state == "cool":
                    time.sleep(0.3)
                    for _ in range(3):
                        ex.execute(plan)
                for rep in range(args.reps):
                    if state == "hot":
                        ex.execute(heavy)
                    ex.execute(plan)
                    rows.append({"composition": name, "layout": lay, "state": state, "rep": rep,
                                 "unix_s": time.time(), "time_s": ex.last_gpu_s})
            pd.DataFrame(rows).to_csv(out / "steps.csv", index=False)
    df = pd.DataFrame(rows)
    med = df.groupby(["composition", "layout", "state"])["time_s"].median().unstack(["layout",
                                                                                       "state"])
    base = med[("random", "hot")]
    table = (med.div(base, axis=0) - 1) * 100
    table.columns = [f"{lay}/{state} %" for lay, state in table.columns]
    table.insert(0, "random/hot ms", 1e3 * base)
    print(table.round(1).to_string())


if __name__ == "__main__":
    main()
