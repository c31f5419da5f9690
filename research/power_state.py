"""Does a step's time depend on what the GPU ran just before it? (GPU only; no simpy.)

    python research/power_state.py [--model llama-3.1-8b] [--seconds 3] [--levels 0,0.5,1,...]
        --out DIR

Timed back to back, a compute-bound prefill step is measured while the GPU has been busy with
prefills, and a decode step while it has run decodes; a serving engine mixes them (the profiler
therefore interleaves its repetitions over the whole design, docs/profiling.md). This runs the real executor (block size 16) in a controlled duty
cycle: for each target fraction `h` of device time spent in a heavy prefill step (4,096 new
tokens), light decode steps (16 x 512) fill the rest, and every ~0.25 s two probes are timed
(CUDA-event span of `execute`): an eager prefill step as serving runs them (1,100 new tokens
and 48 decodes of 1,024) and a large decode graph (192 decodes of 1,000 tokens). The SM clock
is read with nvidia-smi beside each probe. Writes `power_state.csv` (level, h, probe, time_s,
sm_clock_mhz, heavy_fraction_1s: the heavy share of device time over the last second) and
prints the median per level and probe relative to the first level (h = 0). The committed
measurement is profiles/h200/llama-3.1-8b/probes/power_state.csv (H200, 2026-11-29, 3 s levels),
taken by a first form that read the clock just before the probes, so that each probe followed
the tens of ms of idle GPU that the nvidia-smi query takes.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LEVELS = (0.0, 0.5, 1.0, 0.25, 0.75, 0.0)
HEAVY = [(0, 4096, False)]
LIGHT = [(511, 1, True)] * 16
PROBES = {"eager_prefill_1100_d48": [(0, 1100, False)] + [(1023, 1, True)] * 48,
          "decode_graph_b192_c1000": [(999, 1, True)] * 192}


def _sm_clock() -> float:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,"
                              "nounits"], capture_output=True, text=True, timeout=5).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--seconds", type=float, default=3.0, help="per level, after 1 s settling")
    ap.add_argument("--levels", default=",".join(f"{h:g}" for h in LEVELS),
                    help="comma-separated heavy fractions, in order")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from simkv.specs import load_model
    from simkv.gpu.profiler import _plan, _tokens, profiling_executor

    bs = 16
    model = load_model(args.model)
    rng = np.random.default_rng(0)
    executor = profiling_executor(model, 40_000, bs, args.device)
    tokens = _tokens(executor, rng)
    perm = rng.permutation(executor.num_blocks)
    plans = {"heavy": _plan(HEAVY, bs, perm, tokens), "light": _plan(LIGHT, bs, perm, tokens)}
    plans.update({k: _plan(v, bs, perm, tokens) for k, v in PROBES.items()})
    for plan in plans.values():          # warm-up (and graph capture checks)
        executor.execute(plan)

    import pandas as pd
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    levels = [float(x) for x in args.levels.split(",")]
    rows, history = [], []                 # history: (end wall time, device s, heavy?)
    for level, h in enumerate(levels):
        busy = {"heavy": 0.0, "all": 1e-9}
        start = time.perf_counter()
        next_probe = start + 1.0
        while time.perf_counter() - start < 1.0 + args.seconds:
            kind = "heavy" if busy["heavy"] / busy["all"] < h else "light"
            executor.execute(plans[kind])
            gpu_s = executor.last_gpu_s
            busy[kind] = busy.get(kind, 0.0) + gpu_s
            busy["all"] += gpu_s
            now = time.perf_counter()
            history.append((now, gpu_s, kind == "heavy"))
            if now >= next_probe:
                window = [(g, hv) for t, g, hv in history if t >= now - 1.0]
                frac = sum(g for g, hv in window if hv) / max(1e-9, sum(g for g, _ in window))
                probed = []
                for name in PROBES:
                    executor.execute(plans[name])
                    probed.append({"level": level, "h": h, "probe": name,
                                   "time_s": executor.last_gpu_s,
                                   "t_s": round(time.perf_counter() - start, 3),
                                   "heavy_fraction_1s": round(frac, 3)})
                clock = _sm_clock()     # after the probes: the query leaves the GPU idle a while
                rows += [dict(r, sm_clock_mhz=clock) for r in probed]
                next_probe = time.perf_counter() + 0.25
        pd.DataFrame(rows).to_csv(out / "power_state.csv", index=False)   # after every level
    _print_medians(pd.DataFrame(rows))


def _print_medians(df) -> None:
    """Median time, clock and heavy share per probe and level, relative to the first level."""
    med = df.groupby(["probe", "level", "h"]).agg(
        time_ms=("time_s", lambda s: 1e3 * s.median()), clock=("sm_clock_mhz", "median"),
        heavy=("heavy_fraction_1s", "median"), n=("time_s", "size")).reset_index()
    first = med[med["level"] == 0].set_index("probe")["time_ms"]
    med["vs_first_h0"] = med["time_ms"] / med["probe"].map(first)
    print(med.round(3).to_string(index=False))


if __name__ == "__main__":
    main()
