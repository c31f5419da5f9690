"""What the cluster layer costs: a 16-replica fleet against its 16 partitions simulated one
after another, in one process, CPU seconds (time.process_time), alternated.

    python benchmarks/fleet_overhead.py [--replicas 16] [--speedup 16] [--limit N] [--rounds 3]
                                        [--router round_robin|least_requests|...]

The fleet serves the Azure conversation trace at `--speedup` x its recorded rate; each
partition is the requests the router sent to one replica, simulated alone with the same
scenario. Both sides take the same path (decode runs where the router allows them);
construction (cost models, pools) is outside the timing, the run and its result frames inside.
Under round robin (and random) the replicas cannot see one another and the fleet runs each on
its own clock, one after another; under a router that reads the replicas' state they share one
clock, step by step interleaved, and the partitions are taken from the fleet's own assignment
(its `replica` column). The replicas' results equal the partitions' under round robin
(tests/test_fleet.py), so the difference is the layer's own time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simkv.config.scenario import load_scenario  # noqa: E402
from simkv.sim.cluster.fleet import Fleet  # noqa: E402
from simkv.sim.cluster.router import assign  # noqa: E402
from simkv.sim.engine import Simulation  # noqa: E402
from simkv.workload.frames import load_requests_frame  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--speedup", type=float, default=16.0)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--router", default="round_robin")
    args = ap.parse_args()
    if not TRACE.exists():
        print(f"shared trace absent: {TRACE}")
        return 0
    raw = {"name": "fleet-overhead", "model": "llama-3.1-8b", "gpu": "h200",
           "scheduler": {"max_model_len": 16384},
           "workload": {"trace": str(TRACE), "format": "azure",
                        "time_scale": 1 / args.speedup, "limit": args.limit},
           "cluster": {"pools": [{"name": "h200", "replicas": args.replicas}],
                       "router": {"policy": args.router}}}
    scn = load_scenario(raw)
    frame = load_requests_frame(scn)
    if args.router in ("round_robin", "random"):
        picks = assign(args.router, frame["arrival_s"].tolist(), args.replicas, scn.seed)
    else:   # the assignment the fleet itself makes
        routed = Fleet(scn, frame).run().requests.sort_values("request_id")
        index = {name: i for i, name in enumerate(f"h200-{k}" for k in range(args.replicas))}
        by_id = dict(zip(routed["request_id"], routed["replica"].map(index)))
        picks = [by_id[rid] for rid in frame["request_id"]]
    parts = [frame[[p == i for p in picks]].reset_index(drop=True)
             for i in range(args.replicas)]
    pool = scn.cluster.pools[0].scenario
    fleet_s, parts_s = [], []
    for _ in range(args.rounds):
        fleet = Fleet(scn, frame)
        t = time.process_time()
        fleet.run()
        fleet_s.append(time.process_time() - t)
        sims = [Simulation(pool, part) for part in parts]
        t = time.process_time()
        for sim in sims:
            sim.run()
        parts_s.append(time.process_time() - t)
        print(f"fleet {fleet_s[-1]:.2f} s, partitions {parts_s[-1]:.2f} s, "
              f"ratio {fleet_s[-1] / parts_s[-1]:.3f}", flush=True)
    f, p = statistics.median(fleet_s), statistics.median(parts_s)
    print(f"{len(frame)} requests, {args.replicas} replicas at {args.speedup:g}x, "
          f"{args.router}: median fleet "
          f"{f:.2f} CPU s, partitions {p:.2f} CPU s, ratio {f / p:.3f}; median of the "
          f"rounds' ratios {statistics.median(a / b for a, b in zip(fleet_s, parts_s)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
