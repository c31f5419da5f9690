"""The tensor-parallel code path on one GPU (issue 32's dry run, before the multi-GPU machines).

With one rank every collective is trivial, but NCCL is initialised, the all-reduces are
captured in the CUDA graphs and the profiler runs through its TP path. Checks: the tiny model's
greedy tokens through the TP engine (one rank) are the one-process engine's; then the all-reduce
timing and a quick TP-1 profile of llama-3.1-8b into OUT/profile. Prints one line per check.
"""
import argparse
import json
import sys
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", help="cuda; cpu to try the script here")
    args = p.parse_args()
    out = Path(args.out)
    import simkv
    from simkv.gpu import tensor_parallel
    from simkv.gpu.engine import run_offline
    from simkv.gpu.profiler.tensor_parallel import run_tp_profile
    from tests.test_engine_cpu import workload
    raw = {"name": "tp-dry-run", "model": "tiny", "seed": 0,
           "cache": {"block_size": 16, "num_gpu_blocks_override": 512, "swap_space_gib": 0.01,
                     "enable_prefix_caching": True},
           "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256},
           "workload": {"synthetic": {"num_requests": 12}}}
    frame = workload()
    one = run_offline(simkv.load_scenario(raw), frame, device=args.device, check_integrity=False)
    ranks = tensor_parallel.run_offline(simkv.load_scenario({**raw, "tensor_parallel_size": 1}),
                                        frame, device=args.device)
    same = ranks["tokens"] == one.tokens
    print(f"tiny, TP engine with one rank: tokens {'equal' if same else 'DIFFER'} "
          f"({len(one.tokens)} samples)", flush=True)
    model = "llama-3.1-8b" if args.device == "cuda" else "tiny"
    folder = run_tp_profile(model, 1, block_sizes=(16,), quick=True, device=args.device,
                            out_dir=str(out / "profile"))
    meta = json.loads((Path(folder) / "meta.json").read_text())
    print(f"quick TP-1 profile of {model} in {folder}: tensor_parallel_size "
          f"{meta['tensor_parallel_size']}, backend {meta['backend']}, link {meta['link']}")
    print((Path(folder) / "allreduce.csv").read_text().splitlines()[:3])
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
