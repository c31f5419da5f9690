"""Served decode batches timed on their own: are they faster than the profile's at full clock?

    python research/serving_batches.py dump SCENARIO MEASURED_DIR OUT.json [--every 40]  # CPU
    python research/serving_batches.py time OUT.json --out DIR                          # GPU

With the clock-state model, the validation runs' decode steps that the model times at full clock
are still ~5% faster than predicted (docs/validation.md), in real-time and saturated runs, at
block sizes 16 and 64; the profiler's grid times decode compositions at 1.00-1.05x their
light-work times (research/clock_probe.py, `profile` phase), which leaves 2-3% unexplained.

`dump` replays a validation run through the simulator with the engine's own step times (as the
per-step diagnostic does), so the KV manager hands out the same blocks, and writes every k-th
decode-only step's contexts and block tables. `time` runs each such batch back to back (3
warm-up steps, 7 timed) with its served block tables and again with the profiler's kind of
table (a random permutation of the pool), writing steps.csv; the profiled model's prediction
for each is then computed on CPU (`report`).

    python research/serving_batches.py report OUT.json DIR/steps.csv
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def dump(scenario_path: str, measured_dir: str, out: str, every: int) -> None:
    from simkv.config.scenario import load_scenario, with_overrides
    from simkv.sim.engine import simulate
    from simkv.costmodel import load_cost_model
    from simkv.workload.frames import load_requests_frame
    from simkv.validation.data import read_run
    from simkv.validation.diagnostics import _PlanReplay
    measured = Path(measured_dir)
    scn = load_scenario(scenario_path)
    run = read_run(measured / "realtime")
    scn = with_overrides(scn, {"cache.num_gpu_blocks_override":
                               int(run["summary"]["num_blocks"])})
    frame = load_requests_frame(scn)
    batches = []

    class Recorder(_PlanReplay):
        steps = 0

        def predict(self, plan):
            k = self.steps
            self.steps += 1
            if plan.num_prefill_tokens == 0 and plan.scheduled and k % every == 0:
                batches.append({"step": k, "block_size": scn.cache.block_size,
                                "contexts": [s.start + 1 for s in plan.scheduled],
                                "tables": [list(s.block_table) for s in plan.scheduled],
                                "num_blocks": scn.cache.num_gpu_blocks_override})
            return super().predict(plan)

    simulate(scn, trace_df=frame, cost_model=Recorder(load_cost_model(scn), run["steps"]))
    Path(out).write_text(json.dumps({"scenario": scenario_path, "batches": batches}))
    print(f"{len(batches)} decode batches written to {out}")


def _plan(contexts, tables, tokens, block_size):
    """The decode step, with its repeated reads (blocks several of its tables hold) and the
    first repeats among them (one per such block) counted."""
    from collections import Counter
    from simkv.profile.design import step_plan
    plan = step_plan([(c - 1, 1, True) for c in contexts], block_size, tables, tokens)
    holders = Counter(b for t in tables for b in t)
    plan.decode_shared_context_tokens = min(plan.decode_context_tokens, block_size * sum(
        n - 1 for n in holders.values()))
    plan.decode_shared_block_tokens = min(plan.decode_shared_context_tokens, block_size * sum(
        n > 1 for n in holders.values()))
    return plan


def time_batches(path: str, out_dir: str, device: str) -> None:
    import pandas as pd
    from simkv.specs import load_model
    from simkv.gpu.profiler import _tokens, profiling_executor
    data = json.loads(Path(path).read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    executors = {}
    for b in data["batches"]:
        bs = b["block_size"]
        if bs not in executors:
            num_blocks = max(max(max(t) for t in b2["tables"]) + 1 for b2 in data["batches"]
                             if b2["block_size"] == bs) + 64
            executors[bs] = profiling_executor(load_model("llama-3.1-8b"), num_blocks, bs,
                                               device)
        ex = executors[bs]
        tokens = _tokens(ex, rng)
        served = _plan(b["contexts"], b["tables"], tokens, bs)
        perm, used, random_tables = rng.permutation(ex.num_blocks).tolist(), 0, []
        for t in b["tables"]:
            random_tables.append(perm[used:used + len(t)])
            used += len(t)
        scattered = _plan(b["contexts"], random_tables, tokens, bs)
        for layout, plan in (("served", served), ("random", scattered)):
            time.sleep(0.05)
            for _ in range(3):
                ex.execute(plan)
            for rep in range(7):
                ex.execute(plan)
                rows.append({"step": b["step"], "block_size": bs, "layout": layout,
                             "batch": len(b["contexts"]), "rep": rep, "time_s": ex.last_gpu_s})
    pd.DataFrame(rows).to_csv(out / "steps.csv", index=False)
    df = pd.DataFrame(rows).groupby(["layout"])["time_s"].median()
    print(df.to_string())


def report(path: str, steps_csv: str) -> None:
    import pandas as pd
    from simkv.specs import load_model
    from simkv.costmodel.profiled import ProfiledCostModel
    data = json.loads(Path(path).read_text())
    df = pd.read_csv(steps_csv).groupby(["step", "block_size", "layout"])["time_s"].median() \
        .unstack("layout").reset_index()
    from simkv.costmodel.shared_reads import load_shared_reads
    models = {}
    pred = []
    profile = ROOT / "profiles/h200/llama-3.1-8b"
    for b in data["batches"]:
        bs = b["block_size"]
        if bs not in models:
            models[bs] = ProfiledCostModel.load(profile, bs, model=load_model("llama-3.1-8b"))
            models[bs].use_shared_reads(load_shared_reads(profile))
        plan = _plan(b["contexts"], b["tables"], None, bs)
        predicted = models[bs].forward_seconds(plan)
        shared = plan.decode_shared_context_tokens
        plan.decode_shared_context_tokens = 0
        pred.append({"step": b["step"], "predicted_s": predicted,
                     "unshared_predicted_s": models[bs].forward_seconds(plan),
                     "batch": len(b["contexts"]), "max_context": max(b["contexts"]),
                     "shared": shared / plan.decode_context_tokens})
    df = df.merge(pd.DataFrame(pred), on="step")
    df["served_vs_model"] = df["served"] / df["predicted_s"] - 1
    # the random tables share nothing: against the model without repeated reads
    df["random_vs_model"] = df["random"] / df["unshared_predicted_s"] - 1
    df["served_vs_random"] = df["served"] / df["random"] - 1
    print(df[["served_vs_model", "random_vs_model", "served_vs_random"]].describe().round(4))
    df["bin"] = pd.cut(df["batch"], [0, 16, 32, 64, 128, 256])
    print(df.groupby("bin", observed=True)[["served_vs_model", "random_vs_model",
                                             "served_vs_random"]].median().round(4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    d = sub.add_parser("dump")
    d.add_argument("scenario")
    d.add_argument("measured_dir")
    d.add_argument("out")
    d.add_argument("--every", type=int, default=40)
    t = sub.add_parser("time")
    t.add_argument("batches")
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="cuda")
    r = sub.add_parser("report")
    r.add_argument("batches")
    r.add_argument("steps_csv")
    args = ap.parse_args()
    if args.verb == "dump":
        dump(args.scenario, args.measured_dir, args.out, args.every)
    elif args.verb == "time":
        time_batches(args.batches, args.out, args.device)
    else:
        report(args.batches, args.steps_csv)


if __name__ == "__main__":
    main()
