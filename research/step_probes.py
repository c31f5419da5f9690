"""Step-time probes beyond the profile's design: where does the fitted model stand?

    python research/step_probes.py measure --out DIR        # GPU (no simpy), ~1 min
    python research/step_probes.py compare DIR              # any machine: against fit.json

Two probes on the real executor (llama-3.1-8b, block size 16, random K/V, median of 5 runs
after a warm-up, as the profiler times a composition):

- `prefill_scan.csv`: steps of 960 to 2,048 tokens every 32 (and 2,560, 3,072, 4,096): one
  prefill chunk alone, or a chunk of tokens - 48 beside 48 decodes of 1,024 tokens, timed back
  to back (up to 1,024 tokens they run as mixed CUDA graphs, above eagerly);
- `decode_mix.csv`: decode graphs of 150 and 200 sequences whose contexts are drawn as serving
  produces them (lognormal around 900 tokens, 64-3,000) plus three long ones (4,096, 5,120,
  6,144), with the long ones first, last or at random places in the batch, against the same
  batch without them and a uniform batch of the same total; three rounds.

`compare` prints each probe's measured time beside what the committed profiled model predicts.
The CSVs in profiles/h200/llama-3.1-8b/probes/ were measured on 2026-11-29 (H200, torch 2.11,
triton 3.6) by the first form of these probes (the scan in a pool of 20,000 blocks).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "llama-3.1-8b"
BLOCK_SIZE = 16


def _decode_mixes(rng) -> dict:
    mixes = {}
    for b in (150, 200):
        base = [int(c) for c in np.clip(rng.lognormal(np.log(900), 0.6, b).astype(int), 64, 3000)]
        ctx = base[:b - 3] + [4096, 5120, 6144]
        mixes[f"b{b}/random"] = [ctx[i] for i in rng.permutation(b)]
        mixes[f"b{b}/long_first"] = sorted(ctx, reverse=True)
        mixes[f"b{b}/long_last"] = sorted(ctx)
        mixes[f"b{b}/no_long"] = base[:b - 3] + [int(np.mean(base))] * 3
        mixes[f"b{b}/uniform"] = [int(np.mean(ctx))] * b
    return mixes


def measure(out: Path) -> None:
    import pandas as pd
    from simkv.specs import load_model
    from simkv.gpu.profiler import _plan, _time, _tokens, profiling_executor

    ex = profiling_executor(load_model(MODEL), 40_000, BLOCK_SIZE, "cuda")
    out.mkdir(parents=True, exist_ok=True)

    rng = np.random.default_rng(0)
    tokens = _tokens(ex, rng)
    perm = rng.permutation(ex.num_blocks)
    rows = []
    for n in list(range(960, 2049, 32)) + [2560, 3072, 4096]:
        for decodes in (0, 48):
            t = _time(ex, _plan(_scan_items(n, decodes), BLOCK_SIZE, perm, tokens), 5)
            rows.append({"tokens": n, "decodes": decodes, **t})
    pd.DataFrame(rows).to_csv(out / "prefill_scan.csv", index=False)

    rng = np.random.default_rng(1)
    tokens = _tokens(ex, rng)
    mixes = _decode_mixes(rng)
    rows = []
    for rnd in range(3):
        for name, ctx in mixes.items():
            items = [(c - 1, 1, True) for c in ctx]
            t = _time(ex, _plan(items, BLOCK_SIZE, rng.permutation(ex.num_blocks), tokens), 5)
            rows.append({"id": name, "round": rnd, "time_s": t["time_s"], "ctx": json.dumps(ctx)})
    pd.DataFrame(rows).to_csv(out / "decode_mix.csv", index=False)
    print(f"wrote {out}/prefill_scan.csv and decode_mix.csv")


def _scan_items(tokens: int, decodes: int) -> list:
    return [(0, tokens - decodes, False)] + [(1023, 1, True)] * decodes


def compare(folder: Path) -> None:
    import pandas as pd
    from simkv.costmodel import step_formula as SF
    from simkv.costmodel.profiled import ProfiledCostModel
    from simkv.profile.design import features

    model = ProfiledCostModel.load(ROOT / "profiles" / "h200" / MODEL, block_size=BLOCK_SIZE)
    layout = model.layout

    def predict(items) -> float:
        f = features([tuple(i) for i in items])
        f["graph"] = int(layout.is_graphed(f["num_prefill_tokens"], f["num_decode_seqs"]))
        f["decode_contexts"] = [s + 1 for s, _, is_decode in items if is_decode]
        return SF.predict_step(model.coefs, f, layout, BLOCK_SIZE)

    scan = folder / "prefill_scan.csv"
    if scan.is_file():
        df = pd.read_csv(scan)
        df["pred_s"] = [predict(_scan_items(n, d)) for n, d in zip(df["tokens"], df["decodes"])]
        df["error"] = df["pred_s"] / df["time_s"] - 1
        print("prefill scan (back to back; eager above 1,024 tokens): model error % by tokens")
        print(df.pivot(index="tokens", columns="decodes", values="error").mul(100).round(1)
              .to_string())
    mix = folder / "decode_mix.csv"
    if mix.is_file():
        df = pd.read_csv(mix).groupby("id").agg(time_s=("time_s", "median"),
                                                ctx=("ctx", "first")).reset_index()
        df["pred_s"] = [predict([(c - 1, 1, True) for c in json.loads(x)]) for x in df["ctx"]]
        df["error_%"] = (100 * (df["pred_s"] / df["time_s"] - 1)).round(1)
        df["time_ms"] = (1e3 * df["time_s"]).round(3)
        df["pred_ms"] = (1e3 * df["pred_s"]).round(3)
        print("decode mixes (graphs): measured vs model")
        print(df[["id", "time_ms", "pred_ms", "error_%"]].to_string(index=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("folder")
    args = ap.parse_args()
    if args.cmd == "measure":
        measure(Path(args.out))
    else:
        compare(Path(args.folder))


if __name__ == "__main__":
    main()
