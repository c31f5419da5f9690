"""A decode step's host input preparation (GraphSteps.run_decode before the replay), on the CPU.

    python benchmarks/decode_prep.py [--repeats 5] [--steps 64] [--batch 100] [--json OUT.json]

The executor has gemma-3-27b's KV cache groups (six sliding-window groups of 1,024 tokens and
one full group, block size 16, max_model_len 16,384) over a tiny model; the forward is not run
(only the preparation is timed). Two ways to time the same code:

- `profile`: as the profiler's grid does: fresh sequences of one context (`--context`), block
  tables from a permutation of the pool, no KV manager (every group uses the whole table), the
  step timed again and again;
- `served`: as the engine serves: `--batch` sequences of ~1,000 tokens (prompts 400-1,400,
  outputs 50-400) on a HybridKVCacheManager of 59,410 blocks (the H200 run's pool) that has
  served a while (finished sequences replaced, so blocks come from a churned free queue and
  the windows have freed blocks), every step allocating a slot per sequence, then timed once;
  `--disturb-mb` of unrelated memory touched between steps (a forward's and the scheduler's
  host work). Beside these: the profile's step with the memory touched between repetitions,
  the served steps without it, and the served steps without the KV manager (kv=None).

Each figure is CPU seconds of the process (time.process_time) per decode, summed over the
timed steps, min and median over `--repeats` rounds; the ways alternate within each round.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from simkv.engine.kv.groups import HybridKVCacheManager
from simkv.engine.plan import ScheduledSeq
from simkv.engine.request import Sequence
from simkv.gpu.executor import GpuExecutor
from simkv.gpu.profiler.grid import profile_kv_groups
from simkv.specs import load_model

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 16, 59_410, 16_384


def gemma_like_spec():
    """tiny-gemma3 with seven layers, one per KV cache group as gemma-3-27b's seven groups."""
    spec = json.loads((ROOT / "tests" / "data" / "tiny-gemma3.json").read_text())
    spec["text_config"].update(num_hidden_layers=7, sliding_window_pattern=7,
                               sliding_window=1024, max_position_embeddings=MAX_MODEL_LEN)
    path = Path(tempfile.mkdtemp()) / "gemma-7-groups.json"
    path.write_text(json.dumps(spec))
    return load_model(str(path))


def graph_steps():
    """(GraphSteps of a CPU executor with the seven groups, its kv_groups); the forward stubbed."""
    spec = gemma_like_spec()
    groups = profile_kv_groups(spec, BLOCK_SIZE)
    ex = GpuExecutor(spec, 64, BLOCK_SIZE, device="cpu", dtype=torch.float32,
                     attention="reference", max_num_seqs=256, max_model_len=MAX_MODEL_LEN,
                     max_num_batched_tokens=8192, static_inputs=True, kv_groups=groups)
    steps = ex.steps
    tokens = torch.zeros(steps.decode_buckets()[-1], dtype=torch.int64)
    steps._replay = lambda graphs, key, make_step: (None, tokens)
    return steps, groups


def profile_plan(batch: int, context: int, rng) -> list:
    """The grid's decode items: fresh sequences, tables from a permutation of the pool."""
    perm = rng.permutation(NUM_BLOCKS)
    blocks = -(-context // BLOCK_SIZE)
    items = []
    for i in range(batch):
        seq = Sequence(seq_id=i, request=None, sample=0, num_tokens=context,
                       token_ids=rng.integers(0, 256, context).tolist())
        seq.block_table = perm[i * blocks:(i + 1) * blocks].tolist()
        items.append(ScheduledSeq(seq, context - 1, 1, True))
    return items


class Served:
    """`batch` running sequences on a KV manager that has served a while (module docstring)."""

    def __init__(self, groups, batch: int, rng, churn: int = 400):
        self.kv = HybridKVCacheManager(groups, NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False,
                                       max_num_batched_tokens=8192)
        self.rng, self.next_id, self.running = rng, 0, []
        for _ in range(batch):
            self._admit()
        while self.next_id < batch + churn:
            self.advance(self.step())

    def _admit(self) -> None:
        prompt = int(self.rng.integers(400, 1400))
        output = int(self.rng.integers(50, 400))
        seq = Sequence(seq_id=self.next_id, request=None, sample=0, num_tokens=prompt,
                       token_ids=self.rng.integers(0, 256, prompt + output).tolist())
        self.next_id += 1
        left = prompt
        while left:                       # chunked prefill, 256 tokens a step
            n = min(256, left)
            assert self.kv.allocate_slots(seq, n)
            seq.num_computed_tokens += n
            left -= n
        seq.num_tokens += 1               # the prefill's sampled token
        self.running.append(seq)

    def step(self) -> list:
        """Finish what is done (admitting a new sequence each), then allocate one slot per
        running sequence; returns the step's decode items."""
        for seq in [s for s in self.running if s.num_tokens >= len(s.token_ids)]:
            self.kv.free(seq)
            self.running.remove(seq)
            self._admit()
        items = []
        for seq in self.running:
            assert self.kv.allocate_slots(seq, 1)
            items.append(ScheduledSeq(seq, seq.num_computed_tokens, 1, True))
        return items

    def advance(self, items) -> None:
        for it in items:
            it.seq.num_computed_tokens += 1
            it.seq.num_tokens += 1


def disturb(scratch: np.ndarray) -> None:
    scratch += 1


def time_profile(steps, items, num_steps: int, kv=None) -> float:
    """CPU seconds of `num_steps` preparations of the same decode step, back to back."""
    t0 = time.process_time()
    for _ in range(num_steps):
        steps.run_decode(items, kv)
    return time.process_time() - t0


def time_served(steps, served: Served, num_steps: int, scratch, use_kv: bool = True) -> tuple:
    """CPU seconds of the preparations of `num_steps` served steps (each once, the manager's
    allocations and `scratch` touched between them); (seconds, decodes)."""
    total, decodes = 0.0, 0
    for _ in range(num_steps):
        items = served.step()
        if scratch is not None:
            disturb(scratch)
        t0 = time.process_time()
        steps.run_decode(items, served.kv if use_kv else None)
        total += time.process_time() - t0
        decodes += len(items)
        served.advance(items)
    return total, decodes


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--disturb-mb", type=float, default=8.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)          # a CUDA step's copies are launches, not host threads
    rng = np.random.default_rng(0)
    steps, groups = graph_steps()
    items = profile_plan(args.batch, args.context, rng)
    served = Served(groups, args.batch, rng)
    scratch = np.zeros(int(args.disturb_mb * 2**20) // 8, dtype=np.int64) \
        if args.disturb_mb else None
    ways = {
        "profile": lambda: (time_profile(steps, items, args.steps), args.steps * args.batch),
        "profile, caches disturbed": lambda: _disturbed_profile(steps, items, args.steps,
                                                                scratch),
        "served": lambda: time_served(steps, served, args.steps, scratch),
        "served, no disturbance": lambda: time_served(steps, served, args.steps, None),
        "served, kv=None": lambda: time_served(steps, served, args.steps, scratch, False),
    }
    us = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            seconds, decodes = way()
            us[name].append(seconds / decodes * 1e6)
    out = {name: {"min_us": min(v), "median_us": float(np.median(v))} for name, v in us.items()}
    for name, v in out.items():
        print(f"{name:28s} {v['min_us']:6.2f} {v['median_us']:6.2f}  us CPU per decode "
              f"(min, median of {args.repeats})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


def _disturbed_profile(steps, items, num_steps: int, scratch) -> tuple:
    total = 0.0
    for _ in range(num_steps):
        disturb(scratch)
        t0 = time.process_time()
        steps.run_decode(items)
        total += time.process_time() - t0
    return total, num_steps * len(items)


if __name__ == "__main__":
    main()
