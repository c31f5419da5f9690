"""The paged KV cache manager: the one question the scheduler asks is "can these tokens have slots?".

`allocate_slots` is all-or-nothing and changes nothing on failure. Prefix caching, copy-on-write
for forked sequences, the admission watermark and swapping to a bounded host pool live here; who
runs next does not (that is the scheduler's business).
"""
from __future__ import annotations

from simkv.engine.kv.block_pool import BlockPool
from simkv.engine.kv.hashing import extend_block_hashes
from simkv.engine.request import Sequence


class HostPool:
    """Host (CPU) swap space: block ids with reference counts (forked siblings share blocks)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))   # pop() hands out the lowest id first

    def take(self) -> int:
        block = self.free.pop()
        self.ref_cnt[block] = 1
        return block

    def release(self, block: int) -> None:
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self.free.append(block)


def first_opening_step(start: int, block_size: int, first_step: int) -> int:
    """The first step from `first_step` on of a decode run in which a sequence that computes
    token `start` in step 1 (token start + k - 1 in step k) opens a block; it opens one every
    `block_size` steps from there."""
    return first_step + (1 - first_step - start) % block_size

class PagedKVCacheManager:
    """Blocks on demand, per-sequence block tables, prefix caching, CoW forks, swap (the
    KVManager protocol, simkv.engine.kv.interface)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark: float = 0.0, num_host_blocks: int = 0,
                 duplicate_blocks: bool = False):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.duplicate_blocks = duplicate_blocks   # several blocks indexed under one hash
        self.pool = BlockPool(num_blocks)
        self.host = HostPool(num_host_blocks)
        self.copies: list = []          # (src, dst) copy-on-write copies for this step
        self.seqs: dict = {}            # seq_id -> Sequence holding device or host blocks
        self._lookup_memo = None        # (seq, blocks, pool removals, hits) of the last lookup
        # statistics
        self.num_cow_copies = 0
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.free_queue.size

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.free_queue.size

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free

    def shared_of(self, seqs) -> tuple:
        """The parts of `num_shared_block_refs` and `num_shared_blocks` that `seqs`' tables
        account for, as (refs, blocks). refs: per shared block they hold, min(how many of them
        hold it, its references beyond the first); blocks: the shared blocks they hold that at
        most one other table holds. What is left are the repeats among the other tables and the
        blocks that two or more of those hold."""
        ref_cnt = self.pool.ref_cnt
        held: dict = {}
        for seq in seqs:
            for b in seq.block_table:
                if ref_cnt[b] > 1:
                    held[b] = held.get(b, 0) + 1
        refs = blocks = 0
        for b, count in held.items():
            beyond_first = ref_cnt[b] - 1
            if count >= beyond_first:
                refs += beyond_first
                blocks += 1
            else:
                refs += count
        return refs, blocks

    def shared_refs_of(self, seqs) -> int:
        """The part of `num_shared_block_refs` that `seqs`' tables account for (`shared_of`)."""
        return self.shared_of(seqs)[0]

    @property
    def num_shared_block_refs(self) -> int:
        """Device-block references beyond the first, over every table that holds blocks (forks,
        prefix-cache hits): sum of (holders - 1) over the blocks."""
        return self.pool.num_shared_refs

    @property
    def num_shared_blocks(self) -> int:
        """Device blocks that two or more tables hold."""
        return self.pool.num_shared_blocks

    def seq_slots(self, seq: Sequence) -> int:
        """Token slots held for a sequence (its table's blocks times the block size)."""
        return len(seq.block_table) * self.block_size

    def allocated_slots(self, table_blocks: int, running) -> int:
        """Token slots the running sequences hold: their tables' blocks times the block size."""
        return table_blocks * self.block_size

    def is_free(self, block: int) -> bool:
        return block in self.pool.free_queue

    def appends_in_place(self, seq: Sequence, tokens: int) -> bool:
        """Whether the sequence's decode tokens after its first `tokens` land in its own
        blocks: its table holds exactly the blocks of `tokens` tokens, a partial tail block is
        its own (a shared one is copied first) and, with prefix caching, its full blocks are
        registered. A decode run (simkv.engine.decode_run) needs it of every sequence."""
        table, bs = seq.block_table, self.block_size
        if len(table) != -(-tokens // bs):
            return False
        if self.enable_prefix_caching and seq.num_cached_blocks != tokens // bs:
            return False
        return not tokens % bs or self.pool.ref_cnt[table[-1]] == 1

    def append_decode_tokens(self, seqs: list, starts: list, steps: int,
                             first_step: int = 1) -> list:
        """Slots for the tokens of steps `first_step`..`steps` of a decode run, as those steps'
        `allocate_slots(seq, 1)` in `seqs` order would give them (sequence i computing token
        starts[i] + k - 1 in step k, each `appends_in_place` before `first_step`, enough free
        blocks): a block where a token opens one, taken from the free queue in step order and
        then sequence order; the blocks that fill registered (their hashes are the sequences'
        own, so the order of registering does not matter). Returns the blocks taken in each
        step (index 0 unused)."""
        bs = self.block_size
        opens = []                       # (step, sequence index) of each block opened
        for i, c in enumerate(starts):
            opens.extend((k, i) for k in range(first_opening_step(c, bs, first_step),
                                                steps + 1, bs))
        opened = [0] * (steps + 1)
        if opens:
            opens.sort()
            blocks = self.pool.take(len(opens))
            for (k, i), block in zip(opens, blocks):
                seqs[i].block_table.append(block)
                opened[k] += 1
        if self.enable_prefix_caching:
            for seq, c in zip(seqs, starts):
                if (c + steps) // bs > seq.num_cached_blocks:
                    self._cache_full_blocks(seq, c + steps)
        return opened

    def blocks_needed(self, num_tokens: int, n: int = 1, prompt_tokens: int = 0) -> int:
        """Blocks a request needs at its longest: n samples share the prompt's full blocks."""
        per_seq = -(-num_tokens // self.block_size)
        shared = prompt_tokens // self.block_size if n > 1 else 0
        return per_seq + (n - 1) * (per_seq - shared)

    def max_admissible_blocks(self) -> int:
        return self.num_blocks - self.watermark_blocks

    def prefix_lookup(self, seq: Sequence) -> tuple:
        """Cached blocks for a sequence's leading full blocks: (blocks, tokens). Changes nothing.

        A hit is whole blocks and leaves at least one token to compute (vLLM: the last token's
        logits are needed).
        """
        if not self.enable_prefix_caching or seq.num_computed_tokens:
            return (), 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(seq, max_blocks, self.block_size)
        pool = self.pool
        memo = self._lookup_memo
        if memo is not None and memo[0] is seq and memo[1] == max_blocks \
                and memo[2] == pool.num_removals:
            # The same head of the queue asks again (memory is full): no block left the index
            # since, so its hits stand unless its first miss has been registered meanwhile. (A
            # duplicate indexed since changes no lookup: a hash's oldest block answers.)
            hits = memo[3]
            if len(hits) == max_blocks or hashes[len(hits)] not in pool.cached:
                return list(hits), len(hits) * self.block_size
        lookup = pool.cached.get
        hits = []
        for i in range(max_blocks):
            block = lookup(hashes[i])
            if block is None:
                break
            hits.append(block)
        self._lookup_memo = (seq, max_blocks, pool.num_removals, hits)
        return list(hits), len(hits) * self.block_size

    # -- allocation ---------------------------------------------------------------------------
    def tail_append(self) -> tuple:
        """What a caller needs to make `allocate_slots(seq, 1)`'s first case itself: (block
        size, the pool's reference counts, the registering of full blocks or None without
        prefix caching). A sequence with c computed tokens, c % block size != 0, whose table
        holds c // block size + 1 blocks, the last with one reference, takes its next token in
        place; where c + 1 fills the block, the block is registered (cache_full(seq, c + 1))."""
        return (self.block_size, self.pool.ref_cnt,
                self._cache_full_blocks if self.enable_prefix_caching else None)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks=(),
                       admission: bool = False, reserve_tokens: int = 0) -> bool:
        """Give `seq` slots for its cached blocks plus `num_new_tokens` more; all or nothing.

        `cached_blocks` come from `prefix_lookup` (only on admission). With `admission`, the
        watermark's blocks must stay free afterwards. With `reserve_tokens`, the free blocks
        must also cover the sequence's first `reserve_tokens` tokens (its whole prompt: the
        full-prompt admission gate), though only the slots asked for are taken. Returns False
        and changes nothing when the pool cannot serve the request.
        """
        bs = self.block_size
        table = seq.block_table
        if num_new_tokens == 1 and not cached_blocks:
            # The common decode: the token lands in the sequence's own partial tail block.
            start = seq.num_computed_tokens
            if start % bs and len(table) == start // bs + 1 \
                    and self.pool.ref_cnt[table[-1]] == 1:
                if (start + 1) % bs == 0 and self.enable_prefix_caching:
                    self._cache_full_blocks(seq, start + 1)
                return True
            if not start % bs and len(table) == start // bs and not admission \
                    and not reserve_tokens:
                # The other common decode: the token opens the sequence's next block (what
                # the general case below does for it: one block, no copy, no reserve)
                pool = self.pool
                if not pool.free_queue.size:
                    return False
                table.extend(pool.take(1))
                self.seqs[seq.seq_id] = seq
                if self.enable_prefix_caching and (start + 1) // bs > seq.num_cached_blocks:
                    self._cache_full_blocks(seq, start + 1)
                return True
        num_cached = len(cached_blocks)
        start = seq.num_computed_tokens + num_cached * bs
        end = start + num_new_tokens
        num_new_blocks = -(-end // bs) - len(table) - num_cached
        if num_new_blocks < 0:
            num_new_blocks = 0
        pool = self.pool
        # Appending into a shared partial tail needs a private copy first.
        cow = bool(table) and start % bs != 0 and num_new_tokens > 0 \
            and pool.ref_cnt[table[-1]] > 1
        need = num_new_blocks + cow
        if reserve_tokens > end:
            need += max(0, -(-reserve_tokens // bs) - max(-(-end // bs), len(table) + num_cached))
        if need or num_cached:
            available = pool.free_queue.size
            if num_cached:
                available -= pool.count_free_among(cached_blocks)
            if admission:
                available -= self.watermark_blocks
            if need > available:
                return False
        if num_cached:
            pool.touch(cached_blocks)
            table.extend(cached_blocks)
            seq.num_cached_blocks = len(table)
        if cow:
            src = table[-1]
            (dst,) = pool.take(1)
            pool.release((src,))
            table[-1] = dst
            self.copies.append((src, dst))
            self.num_cow_copies += 1
        if num_new_blocks:
            table.extend(pool.take(num_new_blocks))
        self.seqs[seq.seq_id] = seq
        if self.enable_prefix_caching and end // bs > seq.num_cached_blocks:
            self._cache_full_blocks(seq, end)
        return True

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that are full once `num_tokens` are computed."""
        num_full = num_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        hashes = seq.block_hashes
        if len(hashes) < num_full:
            hashes = extend_block_hashes(seq, num_full, self.block_size)
        table = seq.block_table
        pool = self.pool
        cached, block_hash = pool.cached, pool.block_hash
        if self.duplicate_blocks:
            # vLLM indexes a block whose hash is already indexed too (BlockPool.
            # cache_full_blocks -> BlockHashToBlockMap.insert), so it stays hittable after
            # the first is evicted (tests/test_duplicate_blocks.py)
            duplicates = pool.duplicates
            for i in range(seq.num_cached_blocks, num_full):   # pool.cache(.., True), inlined
                block, h = table[i], hashes[i]
                if block_hash[block] is None:
                    if h in cached:
                        duplicates.setdefault(h, []).append(block)
                    else:
                        cached[h] = block
                    block_hash[block] = h
        else:
            # pool.cache(block, h), inlined: a hash already indexed keeps its block (setdefault
            # hands that one back), and an unhashed block is never the one indexed
            register = cached.setdefault
            for i in range(seq.num_cached_blocks, num_full):
                block, h = table[i], hashes[i]
                if block_hash[block] is None and register(h, block) is block:
                    block_hash[block] = h
        seq.num_cached_blocks = num_full

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int | None = None) -> None:
        """The child shares every block of the parent (or those holding its first `num_tokens`
        tokens, to re-fork after a recompute); nothing is allocated."""
        table = parent.block_table
        num_cached = parent.num_cached_blocks
        if num_tokens is not None:
            table = table[:-(-num_tokens // self.block_size)]
            num_cached = min(num_cached, num_tokens // self.block_size)
        child.block_table = list(table)
        child.num_cached_blocks = num_cached
        child.block_hashes = list(parent.block_hashes[:num_cached])
        self.pool.touch(child.block_table)
        self.seqs[child.seq_id] = child

    def free(self, seq: Sequence) -> None:
        """Release everything a sequence holds, device and host; the tail is evicted first.

        Call it while `seq.num_computed_tokens` still counts what was computed (see _release).
        """
        if seq.block_table:
            self._release(seq)
            seq.block_table = []
        if seq.host_table:
            for block in seq.host_table:
                self.host.release(block)
        seq.host_table = None
        seq.num_cached_blocks = 0
        self.seqs.pop(seq.seq_id, None)

    def _release(self, seq: Sequence) -> None:
        """Drop the sequence's device references, tail first.

        Fix: full blocks are hashed when their slots are allocated, before the step computes them
        (so that prompts admitted together share). If the sequence is freed before that step runs
        (an admission rolled back, a request preempted in the step that scheduled it), such a
        block used to go back to the free queue still hashed, and a later lookup hit K/V that
        was never computed. A block not fully computed by this sequence, whose last reference
        this is, now loses its hash first.
        """
        pool = self.pool
        table = seq.block_table
        if self.enable_prefix_caching:
            for block in table[seq.num_computed_tokens // self.block_size:]:
                if pool.ref_cnt[block] == 1:
                    pool.uncache(block)
        pool.release(reversed(table))

    def take_copies(self) -> list:
        """The (src, dst) block copies recorded since the last call."""
        copies, self.copies = self.copies, []
        return copies

    # -- swap ---------------------------------------------------------------------------------
    def swap_out(self, seqs) -> list | None:
        """Move the sequences' blocks to host memory: (device, host) pairs, or None if it is full.

        Blocks shared among the sequences (forks) move once. The device blocks are released (a
        block still used by another request stays where it is).
        """
        distinct = dict.fromkeys(b for seq in seqs for b in seq.block_table)
        if len(distinct) > len(self.host.free):
            return None
        mapping = {b: self.host.take() for b in distinct}
        counts: dict = {}
        for seq in seqs:
            seq.host_table = [mapping[b] for b in seq.block_table]
            for block in seq.host_table:
                counts[block] = counts.get(block, 0) + 1
        for block, count in counts.items():   # one reference per table that holds the block
            self.host.ref_cnt[block] = count
        for seq in seqs:
            self._release(seq)
            seq.block_table = []
            seq.num_cached_blocks = 0
        self.swapped_out_blocks += len(mapping)
        return list(mapping.items())

    def can_swap_in(self, seqs) -> bool:
        distinct = {b for seq in seqs for b in seq.host_table}
        return len(distinct) <= len(self.pool.free_queue) - self.watermark_blocks

    def swap_in(self, seqs) -> list | None:
        """Bring swapped sequences back: (host, device) pairs, or None when blocks are short."""
        if not self.can_swap_in(seqs):
            return None
        distinct = list(dict.fromkeys(b for seq in seqs for b in seq.host_table))
        device = self.pool.take(len(distinct))
        mapping = dict(zip(distinct, device))
        counts: dict = {}
        for seq in seqs:
            seq.block_table = [mapping[b] for b in seq.host_table]
            for block in seq.block_table:
                counts[block] = counts.get(block, 0) + 1
        for block, count in counts.items():      # taken with one reference
            if count > 1:
                self.pool.add_refs(block, count - 1)
        for seq in seqs:
            for block in seq.host_table:
                self.host.release(block)
            seq.host_table = None
            if self.enable_prefix_caching:
                self._cache_full_blocks(seq, seq.num_computed_tokens)
        self.swapped_in_blocks += len(distinct)
        return list(mapping.items())

    # -- integrity ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + in use == total; every refcount equals the tables holding the block; the hash
        index is consistent; host refcounts match host tables. Raises AssertionError."""
        self.pool.check()
        holders = [0] * self.num_blocks
        host_holders = [0] * self.host.num_blocks
        for seq in self.seqs.values():
            for block in seq.block_table:
                holders[block] += 1
            for block in seq.host_table or ():
                host_holders[block] += 1
        assert holders == self.pool.ref_cnt, "a refcount differs from the tables holding it"
        assert host_holders == self.host.ref_cnt, "a host refcount differs from the host tables"
        assert len(self.host.free) == sum(1 for r in self.host.ref_cnt if r == 0)
        for seq in self.seqs.values():
            assert not (seq.block_table and seq.host_table), "a sequence on device and host"
