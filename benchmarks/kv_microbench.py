"""Micro-benchmark of the KV managers: is the manager the simulator's bottleneck?

    python benchmarks/kv_microbench.py [--repeat 5] [--seqs 4096]

Rows (block size 16, prefix caching on, best of --repeat runs):
- append, no new block: a decode step's slot for one token whose block has room (1 in 15 of
  them fills the block and registers its hash, as in real decoding);
- append, new block each: a decode token that starts a new block;
- prompt admission: prefix lookup (miss) + allocate_slots for a 512-token prompt (32 blocks);
- prefix lookup: a new sequence whose 512-token prompt is cached (31 blocks hit), hashes
  computed from scratch;
- the contiguous allocator's append, for comparison.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simkv.engine.kv.contiguous import ContiguousKVCacheManager  # noqa: E402
from simkv.engine.kv.hashing import hash_root  # noqa: E402
from simkv.engine.kv.paged import PagedKVCacheManager  # noqa: E402
from simkv.engine.request import Request, Sequence  # noqa: E402

BS = 16


def new_seq(seq_id: int, prompt: int, ids=None) -> Sequence:
    req = Request(seq_id, 0.0, prompt, 1000, prefix_ids=ids,
                  prefix_block_tokens=BS if ids else 0)
    req.hash_root = hash_root(req, False)
    return Sequence(seq_id, req, 0, prompt)


def prefilled(kv, count: int, prompt: int) -> list:
    """`count` sequences whose prompt is computed and first token sampled."""
    seqs = []
    for i in range(count):
        seq = new_seq(i, prompt)
        assert kv.allocate_slots(seq, prompt)
        seq.num_computed_tokens = prompt
        seq.num_tokens = prompt + 1
        seqs.append(seq)
    return seqs


def bench_append_no_new_block(count: int, kv_class=PagedKVCacheManager, **kw) -> tuple:
    # 49 computed tokens: block 3 holds 48..63, so the next 15 appends need no new block
    kv = kv_class(count * 5, BS, **kw)
    seqs = prefilled(kv, count, 49)
    allocate = kv.allocate_slots
    start = time.perf_counter()
    for _ in range(15):
        for seq in seqs:
            allocate(seq, 1)
            seq.num_computed_tokens += 1
            seq.num_tokens += 1
    return 15 * count, time.perf_counter() - start


def bench_append_new_block(count: int) -> tuple:
    kv = PagedKVCacheManager(count * 5, BS)
    seqs = prefilled(kv, count, 64)          # 4 full blocks: the next token starts block 4
    allocate = kv.allocate_slots
    start = time.perf_counter()
    for seq in seqs:
        allocate(seq, 1)
    assert all(len(seq.block_table) == 5 for seq in seqs)
    return count, time.perf_counter() - start


def bench_admission(count: int) -> tuple:
    kv = PagedKVCacheManager(count * 32, BS)
    seqs = [new_seq(i, 512) for i in range(count)]
    lookup, allocate = kv.prefix_lookup, kv.allocate_slots
    start = time.perf_counter()
    for seq in seqs:
        hits, cached = lookup(seq)
        allocate(seq, seq.num_tokens - cached, hits, admission=True)
    return count, time.perf_counter() - start


def bench_prefix_lookup(count: int) -> tuple:
    kv = PagedKVCacheManager(64, BS)
    ids = tuple(range(32))
    owner = new_seq(0, 512, ids)
    assert kv.allocate_slots(owner, 512)
    seqs = [new_seq(i + 1, 512, ids) for i in range(count)]
    lookup = kv.prefix_lookup
    start = time.perf_counter()
    for seq in seqs:
        lookup(seq)
    assert len(lookup(seqs[0])[0]) == 31
    return count, time.perf_counter() - start


def best(fn, repeat: int, *args, **kw) -> tuple:
    runs = [fn(*args, **kw) for _ in range(repeat)]
    ops, seconds = min(runs, key=lambda r: r[1] / r[0])
    return ops / seconds, seconds / ops * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seqs", type=int, default=4096)
    args = parser.parse_args(argv)
    n = args.seqs
    rows = [
        ("append, no new block (paged)", best(bench_append_no_new_block, args.repeat, n)),
        ("append, new block each (paged)", best(bench_append_new_block, args.repeat, n)),
        ("prompt admission, 512 tokens (paged)", best(bench_admission, args.repeat, n // 4)),
        ("prefix lookup, 31-block hit (paged)", best(bench_prefix_lookup, args.repeat, n)),
        ("append, no new block (contiguous)",
         best(bench_append_no_new_block, args.repeat, n, ContiguousKVCacheManager,
              max_model_len=80)),     # a 5-block slab each
    ]
    print(f"python {sys.version.split()[0]}, block size {BS}, best of {args.repeat}")
    print(f"{'operation':<40}{'ops/s':>14}{'us/op':>10}")
    for name, (rate, micros) in rows:
        print(f"{name:<40}{rate:>14,.0f}{micros:>10.2f}")


if __name__ == "__main__":
    main()
