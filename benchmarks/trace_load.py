"""How long the shared traces take to load (`simkv.workload.traces.load_trace`), in CPU seconds.

    python benchmarks/trace_load.py [--repeats 5] [--target-s 0.5]

Loads the shared Azure conv trace and the Mooncake trace `--repeats` times each and prints the
fastest and median CPU time of the process per load; exits 1 when the median exceeds
`--target-s` (the target a user loading a whole trace should not notice). Traces that are
absent are skipped and named.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "traces"
TRACES = {"azure conv": SHARED / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv",
          "mooncake": SHARED / "mooncake-fast25" / "synthetic_trace.jsonl"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--target-s", type=float, default=0.5)
    a = ap.parse_args(argv)
    from simkv.workload.traces import load_trace
    slow = 0
    for name, path in TRACES.items():
        if not path.is_file():
            print(f"{name}: skipped, no trace at {path}")
            continue
        times = []
        for _ in range(a.repeats):
            start = time.process_time()
            rows = len(load_trace(path))
            times.append(time.process_time() - start)
        median = statistics.median(times)
        slow += median > a.target_s
        print(f"{name}: {rows} requests, {min(times):.3f} s fastest, {median:.3f} s median CPU "
              f"({'over' if median > a.target_s else 'within'} the {a.target_s:g} s target)")
    return 1 if slow else 0


if __name__ == "__main__":
    raise SystemExit(main())
