"""The contiguous-slab baseline: each admitted sequence reserves `max_model_len` tokens up front.

The true length of a request is unknown until it stops, so a server without paging must reserve
the longest possible sequence, in one contiguous range of the pool (first fit). Same interface as
the paged manager, so both run on the same trace; no prefix caching (nothing can be shared in
place), forks copy the parent's used blocks into the child's own slab.
"""
from __future__ import annotations

from simkv.engine.kv.paged import HostPool
from simkv.engine.request import Sequence


class ContiguousKVCacheManager:
    enable_prefix_caching = False

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 watermark: float = 0.0, num_host_blocks: int = 0):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.slab_blocks = -(-max_model_len // block_size)
        self.watermark_blocks = int(watermark * num_blocks)
        self.free_ranges: list = [(0, num_blocks)]        # sorted (start, length)
        self.reservations: dict = {}                        # seq_id -> (start, length)
        self.host = HostPool(num_host_blocks)
        self.copies: list = []
        self.seqs: dict = {}
        self.unforked: dict = {}        # child seq_id -> (child, parent): forks without a slab
        self.num_cow_copies = 0
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self._reserved = 0

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._reserved

    @property
    def num_used_blocks(self) -> int:
        return self._reserved

    num_cached_free_blocks = 0
    num_shared_block_refs = 0        # every sequence has its own range
    num_shared_blocks = 0

    def shared_of(self, seqs) -> tuple:
        return 0, 0

    def shared_refs_of(self, seqs) -> int:
        return 0

    def seq_slots(self, seq: Sequence) -> int:
        res = self.reservations.get(seq.seq_id)
        return res[1] * self.block_size if res else 0

    def is_free(self, block: int) -> bool:
        """Always False here, which keeps every swap-out before the block copies (the order
        the GPU executor has always used for this manager; simkv.gpu.swap.order_swap_outs)."""
        return False

    def allocated_slots(self, table_blocks: int, running) -> int:
        """Token slots the running sequences hold: their whole reservations."""
        return sum(self.seq_slots(seq) for req in running for seq in req.seqs)

    def blocks_needed(self, num_tokens: int, n: int = 1, prompt_tokens: int = 0) -> int:
        return n * self.slab_blocks

    def max_admissible_blocks(self) -> int:
        return self.num_blocks - self.watermark_blocks

    def external_fragmentation(self) -> float:
        """Fraction of the pool that is free but lies in holes too small for one reservation."""
        unusable = sum(length for _, length in self.free_ranges if length < self.slab_blocks)
        return unusable / self.num_blocks

    def prefix_lookup(self, seq: Sequence) -> tuple:
        return (), 0

    # -- allocation ---------------------------------------------------------------------------
    def _find(self, length: int, keep_free: int = 0):
        if self.num_free_blocks - length < keep_free:
            return None
        for i, (start, free_len) in enumerate(self.free_ranges):
            if free_len >= length:
                return i
        return None

    def _reserve(self, index: int, length: int) -> int:
        start, free_len = self.free_ranges[index]
        if free_len == length:
            del self.free_ranges[index]
        else:
            self.free_ranges[index] = (start + length, free_len - length)
        self._reserved += length
        return start

    def _release(self, start: int, length: int) -> None:
        ranges = self.free_ranges
        ranges.append((start, length))
        ranges.sort()
        merged = [ranges[0]]
        for s, n in ranges[1:]:
            ps, pn = merged[-1]
            if ps + pn == s:
                merged[-1] = (ps, pn + n)
            else:
                merged.append((s, n))
        self.free_ranges = merged
        self._reserved -= length

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks=(),
                       admission: bool = False, reserve_tokens: int = 0) -> bool:
        """Reserve a slab on the first allocation; later growth stays inside it (a slab holds
        max_model_len tokens, so `reserve_tokens` always fits once one is found)."""
        end = seq.num_computed_tokens + num_new_tokens
        needed = -(-end // self.block_size)
        res = self.reservations.get(seq.seq_id)
        if res is None:
            # Fix: a fork child that found no slab used to get a fresh slab here without the
            # parent's K/V (no copy recorded). Copy the parent's used blocks now (a parent that
            # is freed first hands its slab over instead: see free).
            parent = self.unforked.get(seq.seq_id, (None, None))[1]
            index = self._find(self.slab_blocks, self.watermark_blocks if admission else 0)
            if index is None:
                return False
            start = self._reserve(index, self.slab_blocks)
            res = self.reservations[seq.seq_id] = (start, self.slab_blocks)
            self.seqs[seq.seq_id] = seq
            if parent is not None:
                del self.unforked[seq.seq_id]
                used = -(-seq.num_computed_tokens // self.block_size)
                seq.block_table = list(range(start, start + used))
                self.copies.extend(zip(parent.block_table[:used], seq.block_table))
                self.num_cow_copies += used
        if needed > res[1]:
            return False
        table = seq.block_table
        if needed > len(table):
            table.extend(range(res[0] + len(table), res[0] + needed))
        return True

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int | None = None) -> None:
        """The child gets its own slab; the parent's used blocks (those holding its first
        `num_tokens` tokens, when given) are copied into it.

        A fork that finds no room leaves the child without blocks; its first allocation takes a
        slab and the copies if one has freed up, else fails and the scheduler preempts, as for any
        sequence that cannot grow.
        """
        res = self.reservations.get(child.seq_id)   # a re-fork may find its swapped-in slab
        if res is None:
            index = self._find(self.slab_blocks)
            if index is None:
                self.unforked[child.seq_id] = (child, parent)
                return
            res = self.reservations[child.seq_id] = (self._reserve(index, self.slab_blocks),
                                                     self.slab_blocks)
        start = res[0]
        used = len(parent.block_table) if num_tokens is None else -(-num_tokens // self.block_size)
        child.block_table = list(range(start, start + used))
        self.copies.extend(zip(parent.block_table, child.block_table))
        self.num_cow_copies += used
        self.seqs[child.seq_id] = child

    def free(self, seq: Sequence) -> None:
        self.unforked.pop(seq.seq_id, None)
        res = self.reservations.pop(seq.seq_id, None)
        heirs = [c for c, p in self.unforked.values() if p is seq] if res and self.unforked else ()
        if heirs:
            # Fix: a child still waiting for a slab needs this sequence's K/V, which no other
            # slab holds (it used to be stranded, and every later request preempted for it):
            # it takes the slab over as it is; its siblings wait on it instead.
            heir = heirs[0]
            del self.unforked[heir.seq_id]
            self.reservations[heir.seq_id] = res
            heir.block_table = list(range(res[0], res[0] - (-heir.num_computed_tokens
                                                            // self.block_size)))
            self.seqs[heir.seq_id] = heir
            for other in heirs[1:]:
                self.unforked[other.seq_id] = (other, heir)
        elif res is not None:
            self._release(*res)
        for block in seq.host_table or ():
            self.host.release(block)
        seq.block_table = []
        seq.host_table = None
        self.seqs.pop(seq.seq_id, None)

    def take_copies(self) -> list:
        copies, self.copies = self.copies, []
        return copies

    # -- swap ---------------------------------------------------------------------------------
    def swap_out(self, seqs) -> list | None:
        """Copy the used blocks to host memory and give the slabs back; None if the host is full."""
        total = sum(len(s.block_table) for s in seqs)
        if total > len(self.host.free):
            return None
        # Fix: a fork child still waiting for its slab holds no blocks of its own (its KV is the
        # parent's); it used to raise KeyError here after the parent had been moved. Refuse
        # instead, before changing anything: the scheduler falls back to recompute.
        if any(s.num_computed_tokens and s.seq_id not in self.reservations for s in seqs):
            return None
        mapping = []
        for seq in seqs:
            seq.host_table = [self.host.take() for _ in seq.block_table]
            mapping.extend(zip(seq.block_table, seq.host_table))
            res = self.reservations.pop(seq.seq_id, None)   # none: a sample waiting to re-fork
            if res is not None:
                self._release(*res)
            seq.block_table = []
        self.swapped_out_blocks += total
        return mapping

    def can_swap_in(self, seqs) -> bool:
        return len(seqs) * self.slab_blocks <= self.num_free_blocks - self.watermark_blocks

    def swap_in(self, seqs) -> list | None:
        """A new slab per sequence and the host blocks copied back; None (nothing changed) when
        the slabs do not fit."""
        if not self.can_swap_in(seqs):
            return None
        starts = []
        for _ in seqs:
            index = self._find(self.slab_blocks)
            if index is None:
                for start in starts:
                    self._release(start, self.slab_blocks)
                return None
            starts.append(self._reserve(index, self.slab_blocks))
        mapping = []
        for seq, start in zip(seqs, starts):
            self.reservations[seq.seq_id] = (start, self.slab_blocks)
            seq.block_table = list(range(start, start + len(seq.host_table)))
            mapping.extend(zip(seq.host_table, seq.block_table))
            for block in seq.host_table:
                self.host.release(block)
            seq.host_table = None
        self.swapped_in_blocks += len(mapping)
        return mapping

    def check_integrity(self) -> None:
        reserved = sum(n for _, n in self.reservations.values())
        assert reserved == self._reserved, "reserved count"
        free = sum(n for _, n in self.free_ranges)
        assert free + reserved == self.num_blocks, "free + reserved != total"
        spans = sorted(list(self.reservations.values()) + self.free_ranges)
        for (s1, n1), (s2, _) in zip(spans, spans[1:]):
            assert s1 + n1 <= s2, "overlapping ranges"
        for seq in self.seqs.values():
            res = self.reservations.get(seq.seq_id)
            if seq.block_table:
                assert res and seq.block_table[0] == res[0] and len(seq.block_table) <= res[1]
        host_used = sum(len(s.host_table or ()) for s in self.seqs.values())
        assert host_used + len(self.host.free) == self.host.num_blocks, "host blocks leaked"
