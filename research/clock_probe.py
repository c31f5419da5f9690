"""How the GPU's clock follows the work it runs: step-time traces for a clock-state model.

    python research/clock_probe.py [--model llama-3.1-8b] --out DIR     # GPU (no simpy), ~3 min

`research/serving_state.py` (H200, 2026-11-29) found that a decode step right after a heavy
prefill runs 7-9% slower than the same step back to back after idle, and that the block-table
layout (random or contiguous) changes it by at most 3%: the SM clock, held down by the 700 W
power cap after heavy work, is what separates the profile (which interleaves every composition
with all the others) from lighter serving. This records, step by step, what a model of that
state needs (each step: its composition, CUDA-event time and the host clock at its end):

- `self`: every composition back to back for 0.8 s after 0.4 s idle: its time at full clock
  (the first steps), the state it settles in by itself, and how fast it gets there;
- `recover`: a heavy composition back to back for 0.5 s, then a light one back to back for
  0.3 s (how fast the clock comes back under light work), and the heavy one followed by idle
  gaps of 0-100 ms before a single light step (how fast it comes back when idle);
- `duty`: a heavy step then k light ones, repeated for 1.2 s (k = 1..16): a mix to check a model
  fitted on the other two phases against;
- `sustain`: a heavy composition back to back for 3 s, then a light one for 0.6 s (twice): the
  slower, deeper fall of the clock under long heavy work, beyond what the other phases last;
- `profile`: the profiler's own step grid (`profile_block_size` over the design, block size 16,
  5 timed rounds as a profile takes them), with the compositions above added to it: their times
  in the state a profile measures them in, against their times after a rest (the `self`
  phase), in the same lease: the factor that turns a profile's times into full-clock times.
  Writes profile_state.csv (one row per composition of the grid, the profiler's columns).

`--phases` picks phases (default: all, in the order above).

nvidia-smi logs the SM clock, power and throttle reasons every 100 ms (smi.csv; host unix time
`t0_unix` in meta.json aligns the two). Writes steps.csv after every phase.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BLOCK_SIZE = 16


def mixed(new: int, decodes: int, ctx: int = 1024) -> list:
    return [(0, new, False)] + [(ctx - 1, 1, True)] * decodes


def compositions(rng) -> dict:
    """name -> items (start, num_tokens, is_decode)."""
    out = {f"decode/b{b}/c{c}": [(c - 1, 1, True)] * b
           for b, c in ((16, 1024), (64, 1024), (256, 1024), (128, 4096))}
    ctx = np.clip(rng.lognormal(np.log(1000), 0.8, 128), 64, 6300).astype(int)
    out["decode/lognormal/b128"] = [(int(c) - 1, 1, True) for c in ctx]
    for new, dec in ((192, 64), (448, 64), (960, 64), (1984, 64), (4032, 64), (8064, 128)):
        out[f"mixed/{new}+{dec}"] = mixed(new, dec)
    out["prefill/1024"] = [(0, 1024, False)]
    out["prefill/8192"] = [(0, 8192, False)]
    out["prefill/2048@6144"] = [(6144, 2048, False)]
    return out


PHASES = ("self", "recover", "duty", "sustain", "profile")
HEAVY = ("prefill/8192", "mixed/1984+64", "mixed/8064+128")
LIGHT = ("decode/b64/c1024", "decode/b256/c1024", "decode/lognormal/b128")


class _Steps:
    """Runs the plans by name and records each step (phase, case, sequence number in the case,
    composition, end time since t0, CUDA-event time)."""

    def __init__(self, ex, plans, t0: float):
        self.ex, self.plans, self.t0 = ex, plans, t0
        self.rows, self.phase, self.case_name, self.seq = [], "", "", 0

    def step(self, name):
        self.ex.execute(self.plans[name])
        self.rows.append({"phase": self.phase, "case": self.case_name, "seq": self.seq,
                          "composition": name, "end_s": round(time.perf_counter() - self.t0, 6),
                          "time_s": round(self.ex.last_gpu_s, 7)})
        self.seq += 1

    def run_for(self, name, seconds):
        stop = time.perf_counter() + seconds
        while time.perf_counter() < stop:
            self.step(name)

    def case(self, phase, name):
        self.phase, self.case_name, self.seq = phase, name, 0


def _self_phase(run: _Steps, comps) -> None:
    for name in list(comps) + list(reversed(list(comps))):
        run.case("self", name)
        time.sleep(0.4)
        run.run_for(name, 0.8)


def _recover_phase(run: _Steps) -> None:
    for _ in range(2):
        for heavy in HEAVY:
            for light in LIGHT:
                run.case("recover", f"{heavy}>{light}")
                time.sleep(0.3)
                run.run_for(heavy, 0.5)
                run.run_for(light, 0.3)
            for gap_ms in (0, 1, 3, 10, 30, 100):
                run.case("recover_idle", f"{heavy}>{gap_ms}ms>{LIGHT[0]}")
                time.sleep(0.3)
                run.run_for(heavy, 0.5)
                time.sleep(gap_ms / 1e3)
                run.step(LIGHT[0])


def _duty_phase(run: _Steps) -> None:
    for heavy in ("mixed/1984+64", "mixed/448+64", "mixed/8064+128"):
        for k in (1, 2, 4, 8, 16):
            run.case("duty", f"{heavy}x1+{LIGHT[2]}x{k}")
            time.sleep(0.3)
            stop = time.perf_counter() + 1.2
            while time.perf_counter() < stop:
                run.step(heavy)
                for _ in range(k):
                    run.step(LIGHT[2])


def _sustain_phase(run: _Steps) -> None:
    for _ in range(2):
        run.case("sustain", f"{HEAVY[2]}>{LIGHT[2]}")
        time.sleep(0.5)
        run.run_for(HEAVY[2], 3.0)
        run.run_for(LIGHT[2], 0.6)


def _profile_phase(ex, comps, rng, out: Path, t0: float) -> None:
    """The profiler's grid with the probe's compositions in it (profile_state.csv)."""
    import pandas as pd
    from simkv.profile.design import Point, design
    from simkv.gpu.profiler import profile_block_size
    points = design() + [Point(name, "probe", [tuple(it) for it in items])
                         for name, items in comps.items()]
    time.sleep(0.4)
    start = round(time.perf_counter() - t0, 6)
    grid = profile_block_size(ex, points, rng, 5, print)
    pd.DataFrame(grid).assign(start_s=start, end_s=round(time.perf_counter() - t0, 6)) \
        .to_csv(out / "profile_state.csv", index=False)


def main() -> None:
    import pandas as pd
    from _probe import probe_executor, probe_parser
    from simkv.gpu.host import nvidia_smi_log
    from simkv.gpu.profiler import _plan
    parser = probe_parser(__doc__)
    parser.add_argument("--phases", default=",".join(PHASES))
    args = parser.parse_args()
    phases = args.phases.split(",")
    if not set(phases) <= set(PHASES):
        raise SystemExit(f"--phases: {args.phases!r}: choose from {','.join(PHASES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with nvidia_smi_log(out / "smi.csv"):
        from simkv.profile.design import MAX_CACHED_TOKENS
        num_blocks = args.num_blocks
        if "profile" in phases:          # the design's largest composition, and ours beside it
            num_blocks = max(num_blocks, MAX_CACHED_TOKENS // BLOCK_SIZE + 2 * 256 + 64)
        out, rng, ex, tokens = probe_executor(args, BLOCK_SIZE, num_blocks)
        comps = compositions(rng)
        perm = rng.permutation(ex.num_blocks)
        plans = {name: _plan(items, BLOCK_SIZE, perm, tokens) for name, items in comps.items()}
        for plan in plans.values():                      # warm-up, graph checks
            ex.execute(plan)
        t0 = time.perf_counter()
        (out / "meta.json").write_text(json.dumps({
            "t0_unix": time.time(), "model": args.model, "block_size": BLOCK_SIZE,
            "compositions": {k: [list(map(int, it)) for it in v] for k, v in comps.items()}}))
        run = _Steps(ex, plans, t0)
        for phase, run_phase in (("self", lambda: _self_phase(run, comps)),
                                 ("recover", lambda: _recover_phase(run)),
                                 ("duty", lambda: _duty_phase(run)),
                                 ("sustain", lambda: _sustain_phase(run))):
            if phase in phases:
                run_phase()
            pd.DataFrame(run.rows).to_csv(out / "steps.csv", index=False)   # after every phase
        if "profile" in phases:
            _profile_phase(ex, comps, rng, out, t0)
    if "self" in phases:
        _print_self_summary(pd.DataFrame(run.rows))


def _print_self_summary(df) -> None:
    """Per composition of the `self` phase: its first steps' time, its settled time, the drift."""
    s = df[df["phase"] == "self"]
    summary = s.groupby("composition")["time_s"].agg(
        first_ms=lambda x: 1e3 * x.iloc[:2].median(), last_ms=lambda x: 1e3 * x.iloc[-5:].median(),
        n="size")
    summary["drift_%"] = 100 * (summary["last_ms"] / summary["first_ms"] - 1)
    print(summary.round(2).to_string())


if __name__ == "__main__":
    main()
