"""A step's host inputs: per-item token ids, positions, cache slots and block tables, built with
numpy and sent to the device in one copy per integer dtype (`Staging`)."""
from __future__ import annotations

import numpy as np
import torch

# Triton compiles a kernel variant per pointer alignment (16 bytes or not) and per integer
# argument equal to 1 or divisible by 16. Arrays packed into one upload start 16-byte aligned and
# block tables are padded to a multiple of 16 columns, so that a run meets a handful of variants,
# all compiled by `GpuExecutor.warmup()`, instead of compiling (for ~1 s) in the middle of a
# measured step.
ALIGN_BYTES = 16
TABLE_WIDTH_MULTIPLE = 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Staging:
    """A growable host buffer (pinned on CUDA) and its device copy, one per integer dtype."""

    def __init__(self, dtype, device):
        self.dtype = dtype
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = torch.empty(0, dtype=dtype)

    def upload(self, arrays: list) -> list:
        """Pack host arrays into one buffer, copy it to the device once; returns device views."""
        align = ALIGN_BYTES // self.host.element_size()
        sizes = [len(a) for a in arrays]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += cdiv(n, align) * align
        if self.host.numel() < total:
            self.host = torch.empty(max(total, 2 * self.host.numel(), 1024), dtype=self.dtype,
                                    pin_memory=self.pinned)
        view = self.host.numpy()
        for a, n, offset in zip(arrays, sizes, offsets):
            view[offset:offset + n] = a
        if self.device.type == "cuda":
            dev = self.host[:total].to(self.device, non_blocking=True)
        else:
            dev = self.host[:total].clone()
        return [dev[offset:offset + n] for n, offset in zip(sizes, offsets)]


def host_inputs(items, block_size: int):
    """Per item: token ids, positions, cache slots, block-table row, context and query length."""
    bs = block_size
    ids, pos, slots, tables, seq_lens, q_lens = [], [], [], [], [], []
    for it in items:
        seq = it.seq
        start, n = it.start, it.num_tokens
        table = np.asarray(seq.block_table, dtype=np.int64)
        p = np.arange(start, start + n, dtype=np.int64)
        ids.append(np.asarray(seq.token_ids[start:start + n], dtype=np.int64))
        pos.append(p)
        slots.append(table[p // bs] * bs + p % bs)
        tables.append(table[:cdiv(start + n, bs)])
        seq_lens.append(start + n)
        q_lens.append(n)
    return ids, pos, slots, tables, seq_lens, q_lens


def pad_tables(tables: list) -> np.ndarray:
    """The block tables as one int32 array, zero-padded to a multiple of TABLE_WIDTH_MULTIPLE
    columns."""
    width = cdiv(max(len(t) for t in tables), TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
    out = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


def group_tables(block_table, counts, full: list, windows: list, start: int, num_tokens: int,
                 block_size: int) -> list:
    """Per KV cache group, a sequence's block table over its first `num_tokens` tokens (int64,
    ceil(num_tokens / block_size) entries), for a step from token `start` on.

    `block_table` lists the sequence's live blocks group after group, `counts[g]` of them in
    group g (the KV manager's `group_blocks_of`); `full[g]`: group g is full attention. Every
    group's table has as many entries as a full-attention group's (one per allocated block), a
    window group's leading ones freed: they hold no token any query of the step attends to, are
    never read, and are 0 here. `counts` None (warm-up, the profiler's synthetic sequences: no
    KV manager): every group uses the whole table, a window group (`windows[g]` tokens) with
    the entries 0 that a KV manager would have freed by `start`, so that the tables are laid out
    (and cost as much to build) as served ones."""
    flat = np.asarray(block_table, dtype=np.int64)
    used = cdiv(num_tokens, block_size)
    tables = []
    if counts is None:
        for f, window in zip(full, windows):
            lead = 0 if f or not window else min(max(0, start - window + 1) // block_size, used)
            table = np.zeros(used, dtype=np.int64)
            table[lead:] = flat[lead:used]
            tables.append(table)
        return tables
    offsets = np.cumsum([0, *counts])
    length = max([n for n, f in zip(counts, full) if f] or [used])
    for g, n in enumerate(counts):
        table = np.zeros(length, dtype=np.int64)
        table[length - n:] = flat[offsets[g]:offsets[g] + n]
        tables.append(table[:used])
    return tables


def group_host_inputs(items, kv, full: list, windows: list, block_size: int) -> tuple:
    """Per KV cache group: the items' cache slots (an int64 array per item) and block-table rows
    (`group_tables`; `kv` None: no KV manager)."""
    bs = block_size
    slots = [[] for _ in full]
    tables = [[] for _ in full]
    for it in items:
        end = it.start + it.num_tokens
        counts = kv.group_blocks_of(it.seq) if kv is not None else None
        p = np.arange(it.start, end, dtype=np.int64)
        for g, table in enumerate(group_tables(it.seq.block_table, counts, full, windows,
                                               it.start, end, bs)):
            slots[g].append(table[p // bs] * bs + p % bs)
            tables[g].append(table)
    return slots, tables
