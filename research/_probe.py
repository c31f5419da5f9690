"""What the GPU probes in research/ share: their command line and their executor."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def probe_parser(doc: str, reps: int = 12) -> argparse.ArgumentParser:
    """--model, --reps, --out, --device, --num-blocks; a probe adds its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-blocks", type=int, default=40_000)
    return parser


def probe_executor(args, block_size: int, num_blocks: int | None = None) -> tuple:
    """(out folder, made; rng seeded 0; the profiler's executor; random token ids)."""
    from simkv.specs import load_model
    from simkv.gpu.profiler import _tokens, profiling_executor
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    ex = profiling_executor(load_model(args.model), num_blocks or args.num_blocks, block_size,
                            args.device)
    return out, rng, ex, _tokens(ex, rng)
