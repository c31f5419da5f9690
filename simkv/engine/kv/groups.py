"""KV cache groups on one block pool: the KV manager of a model whose layers keep KV in more
than one way (vLLM's hybrid allocator: vllm/v1/core/kv_cache_coordinator.py and
vllm/v1/core/single_type_kv_cache_manager.py).

Each group (simkv.kv_geometry) has its own block table per sequence, drawn from the one pool:

- full attention: the table grows with the sequence, as in `PagedKVCacheManager`;
- sliding window: before a sequence's slots are allocated, the blocks that hold only tokens
  before its window (`get_num_skipped_tokens`: computed - window + 1 tokens) are freed and their
  entries become null (SlidingWindowManager, remove_skipped_blocks). A freed full block keeps its
  hash in the free queue, hittable until the queue hands it out again. After a step's
  allocation a sequence holds at most ceil((window - 1 + tokens scheduled) / block_size) + 1
  blocks in the group (`check_integrity` asserts it);
- linear attention: one block per sequence holds its state (a block of max_model_len tokens,
  mamba_cache_mode 'none'); prefix caching is off for such a model, as vLLM's
  MambaModelConfig.verify_and_update_config sets it (vllm/model_executor/models/config.py).

Prefix hits (HybridKVCacheCoordinator.find_longest_cache_hit): the full-attention groups give
the longest run of leading blocks that each of them has cached (left to right); the window
groups then look, right to left within that length, for ceil((window - 1) / block_size)
contiguous blocks cached in each of them: the hit ends with that run (the blocks before it are
null: outside the window), or, if no such run exists, is the run of leading blocks; the full
groups keep the hit's length. A block is indexed under (group, block hash).

A full-attention model never gets here (simkv.engine.build): its hot path stays the paged
manager's. Not modelled for hybrids: forked samples (parallel_sampling fork), swapping (a
preemption recomputes), decode runs (every step is planned on its own).
"""
from __future__ import annotations

from simkv.engine.kv.block_pool import BlockPool
from simkv.engine.kv.hashing import extend_block_hashes
from simkv.engine.kv.paged import HostPool
from simkv.engine.request import Sequence

NULL = -1          # a table entry whose block was freed (before the window) or never taken


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _SeqTables:
    """One sequence's tables: per group the block ids (NULL for skipped entries), the count of
    leading NULLs, the blocks registered in the index, and the tokens its last allocation
    scheduled."""

    __slots__ = ("tables", "skipped", "cached", "last_new")

    def __init__(self, num_groups: int):
        self.tables = [[] for _ in range(num_groups)]
        self.skipped = [0] * num_groups
        self.cached = [0] * num_groups
        self.last_new = 0


class HybridHit:
    """A prefix hit across groups: per group the blocks (NULL before a window), and its tokens."""

    __slots__ = ("blocks", "tokens")

    def __init__(self, blocks: list, tokens: int):
        self.blocks = blocks
        self.tokens = tokens

    def __bool__(self) -> bool:
        return self.tokens > 0


class HybridKVCacheManager:
    """The KVManager protocol (simkv.engine.kv.interface) over KV cache groups (module
    docstring). `groups`: `simkv.sizing.Sizing.kv_groups` entries (attention_type, window,
    block_size)."""

    def __init__(self, groups, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, watermark: float = 0.0,
                 max_num_batched_tokens: int = 8192, duplicate_blocks: bool = False):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kinds = [g["attention_type"] for g in groups]
        self.windows = [g["window"] or 0 for g in groups]
        self.group_block_sizes = [g["block_size"] for g in groups]
        self.num_layers = [g["num_layers"] for g in groups]
        self.full = [i for i, k in enumerate(self.kinds) if k == "full"]
        self.sliding = [i for i, k in enumerate(self.kinds) if k == "sliding"]
        self.linear = [i for i, k in enumerate(self.kinds) if k == "linear"]
        self.enable_prefix_caching = enable_prefix_caching and not self.linear
        self.watermark_blocks = int(watermark * num_blocks)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.duplicate_blocks = duplicate_blocks
        self.pool = BlockPool(num_blocks)
        self.host = HostPool(0)                  # no swap space: swapping is not modelled
        self.block_group = [-1] * num_blocks
        self.group_used = [0] * len(groups)      # blocks in use per group
        self.copies: list = []
        self.seqs: dict = {}
        self.state: dict = {}                    # seq_id -> _SeqTables
        self.num_cow_copies = 0
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.pool.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.pool.free_queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free

    @property
    def num_shared_block_refs(self) -> int:
        return self.pool.num_shared_refs

    @property
    def num_shared_blocks(self) -> int:
        return self.pool.num_shared_blocks

    def shared_of(self, seqs) -> tuple:
        """As PagedKVCacheManager.shared_of, over the sequences' live blocks of every group."""
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

    def seq_slots(self, seq: Sequence) -> int:
        """Token slots of the sequence's live blocks, every group."""
        return len(seq.block_table) * self.block_size

    def allocated_slots(self, table_blocks: int, running) -> int:
        """Slots the running sequences hold, counted so that what the caller subtracts (their
        computed tokens and this step's) leaves the unfilled slots of every group: per
        sequence its tokens after the step plus, per attention group, its live slots less the
        tokens they hold (a linear-attention state block holds no token slot: none wasted). A
        running sequence this step leaves out counts its last allocation's tokens."""
        bs, kinds = self.block_size, self.kinds
        total = 0
        for req in running:
            for seq in req.seqs:
                st = self.state.get(seq.seq_id)
                if st is None:
                    continue
                tokens = seq.num_computed_tokens + st.last_new
                waste = 0
                for g, table in enumerate(st.tables):
                    if kinds[g] == "linear":
                        continue
                    skipped = st.skipped[g]
                    live = len(table) - skipped
                    waste += max(0, live * bs - (tokens - skipped * bs))
                total += tokens + waste
        return total

    def is_free(self, block: int) -> bool:
        return block in self.pool.free_queue

    def group_blocks_of(self, seq: Sequence) -> list:
        """Live blocks the sequence holds in each group."""
        st = self.state.get(seq.seq_id)
        if st is None:
            return [0] * len(self.kinds)
        return [len(t) - s for t, s in zip(st.tables, st.skipped)]

    # -- admission ----------------------------------------------------------------------------
    def _group_need(self, g: int, num_tokens: int) -> int:
        """Blocks group g holds for a sequence of `num_tokens` at most (a window with a chunk
        of at most max_num_batched_tokens, vLLM's max_memory_usage_bytes)."""
        kind = self.kinds[g]
        if kind == "linear":
            return 1
        blocks = _cdiv(num_tokens, self.block_size)
        if kind == "sliding":
            window = min(self.windows[g] - 1 + self.max_num_batched_tokens, num_tokens)
            blocks = min(blocks, _cdiv(window, self.block_size) + 1)
        return blocks

    def blocks_needed(self, num_tokens: int, n: int = 1, prompt_tokens: int = 0) -> int:
        """Blocks a request needs at its longest, every group (samples share nothing)."""
        return n * sum(self._group_need(g, num_tokens) for g in range(len(self.kinds)))

    def max_admissible_blocks(self) -> int:
        return self.num_blocks - self.watermark_blocks

    def _num_skipped_tokens(self, g: int, computed: int) -> int:
        """Tokens group g no longer needs once `computed` are computed (get_num_skipped_tokens:
        before the window; a linear state keeps only the last)."""
        kind = self.kinds[g]
        if kind == "sliding":
            return max(0, computed - self.windows[g] + 1)
        if kind == "linear":
            return max(0, computed - 1)
        return 0

    def prefix_lookup(self, seq: Sequence) -> tuple:
        """The cached blocks of the sequence's leading full blocks by the groups' rules (module
        docstring): (HybridHit, tokens), or ((), 0). Changes nothing."""
        if not self.enable_prefix_caching or seq.num_computed_tokens:
            return (), 0
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        if max_blocks <= 0:
            return (), 0
        hashes = extend_block_hashes(seq, max_blocks, bs)
        cached = self.pool.cached
        full, sliding = self.full, self.sliding
        length = max_blocks
        if full:
            length = 0
            for i in range(max_blocks):
                h = hashes[i]
                if not all((g, h) in cached for g in full):
                    break
                length = i + 1
        start = 0
        if sliding and length:
            need = _cdiv(self.windows[sliding[0]] - 1, bs)
            run, found = 0, False
            for i in range(length - 1, -1, -1):
                h = hashes[i]
                if all((g, h) in cached for g in sliding):
                    run += 1
                    if run >= need:
                        start, length, found = i, i + run, True
                        break
                else:
                    run = 0
            if not found:
                start, length = 0, run
        if not length:
            return (), 0
        blocks = [None] * len(self.kinds)
        for g in full:
            blocks[g] = [cached[(g, hashes[i])] for i in range(length)]
        for g in sliding:
            blocks[g] = [NULL] * start + [cached[(g, hashes[i])] for i in range(start, length)]
        return HybridHit(blocks, length * bs), length * bs

    # -- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks=(),
                       admission: bool = False, reserve_tokens: int = 0) -> bool:
        """Slots for the hit (a HybridHit from `prefix_lookup`, admission only) plus
        `num_new_tokens` more in every group; all or nothing (the blocks a window no longer
        needs are freed first, as vLLM's allocate_slots does). With `reserve_tokens`, the free
        blocks must also cover each group's blocks for that many tokens (a window's: at most
        its bound with a full chunk)."""
        bs = self.block_size
        pool = self.pool
        st = self.state.get(seq.seq_id)
        fresh = st is None
        if fresh:
            st = _SeqTables(len(self.kinds))
        else:
            self._remove_skipped(seq, st, seq.num_computed_tokens)
        hit = cached_blocks if cached_blocks else None
        hit_tokens = hit.tokens if hit is not None else 0
        computed = seq.num_computed_tokens + hit_tokens
        end = computed + num_new_tokens
        gbs = self.group_block_sizes
        need = 0
        touched = []
        new_blocks = [0] * len(self.kinds)
        for g, table in enumerate(st.tables):
            required = _cdiv(end, gbs[g])
            if fresh:
                skipped = self._num_skipped_tokens(g, computed) // gbs[g]
                hits = hit.blocks[g] if hit is not None and hit.blocks[g] is not None else ()
                new_blocks[g] = max(required - max(skipped, len(hits)), 0)
                kept = [b for b in hits[skipped:] if b != NULL]
                touched += kept
            else:
                new_blocks[g] = max(required - len(table), 0)
            need += new_blocks[g]
            if reserve_tokens > end:
                live = required - (self._num_skipped_tokens(g, computed) // gbs[g]
                                   if fresh else st.skipped[g])
                need += max(0, self._group_need(g, reserve_tokens) - max(live, 0))
        available = len(pool.free_queue)
        if touched:
            available -= pool.count_free_among(touched)
        if admission:
            available -= self.watermark_blocks
        if need > available:
            return False
        if fresh:
            self.state[seq.seq_id] = st
            self.seqs[seq.seq_id] = seq
            for g, table in enumerate(st.tables):
                skipped = self._num_skipped_tokens(g, computed) // gbs[g]
                hits = hit.blocks[g] if hit is not None and hit.blocks[g] is not None else ()
                kept = [b for b in hits[skipped:] if b != NULL]
                if kept:
                    self._touch(kept, g)
                lead = max(skipped, len(hits) - len(kept))
                table.extend([NULL] * lead)
                table.extend(kept)
                st.skipped[g] = lead
                st.cached[g] = len(table)
        for g, count in enumerate(new_blocks):
            if count:
                st.tables[g].extend(self._take(count, g))
        st.last_new = num_new_tokens
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq, st, end)
        if fresh or any(new_blocks):
            seq.block_table = self._live(st)
        return True

    def _remove_skipped(self, seq: Sequence, st: _SeqTables, computed: int) -> None:
        """Free the window groups' blocks before the window (remove_skipped_blocks), tail of the
        skipped part first."""
        changed = False
        for g in self.sliding:
            skip = min(self._num_skipped_tokens(g, computed) // self.block_size,
                       len(st.tables[g]))
            first = st.skipped[g]
            if skip <= first:
                continue
            table = st.tables[g]
            freed = table[first:skip]
            for i in range(first, skip):
                table[i] = NULL
            st.skipped[g] = skip
            self._release(reversed(freed), g)
            changed = True
        if changed:
            seq.block_table = self._live(st)

    def _cache_full_blocks(self, seq: Sequence, st: _SeqTables, num_tokens: int) -> None:
        """Register each attention group's blocks that are full once `num_tokens` are computed,
        under (group, hash)."""
        num_full = num_tokens // self.block_size
        if num_full <= min(st.cached[g] for g in self.full + self.sliding):
            return
        hashes = extend_block_hashes(seq, num_full, self.block_size)
        pool = self.pool
        for g in self.full + self.sliding:
            table = st.tables[g]
            for i in range(st.cached[g], min(num_full, len(table))):
                block = table[i]
                if block != NULL:
                    pool.cache(block, (g, hashes[i]), self.duplicate_blocks)
            st.cached[g] = max(st.cached[g], num_full)

    def _live(self, st: _SeqTables) -> list:
        return [b for t, s in zip(st.tables, st.skipped) for b in t[s:]]

    def _take(self, count: int, g: int) -> list:
        blocks = self.pool.take(count)
        group = self.block_group
        for b in blocks:
            group[b] = g
        self.group_used[g] += count
        return blocks

    def _touch(self, blocks: list, g: int) -> None:
        ref_cnt = self.pool.ref_cnt
        self.group_used[g] += sum(1 for b in blocks if ref_cnt[b] == 0)
        self.pool.touch(blocks)

    def _release(self, blocks, g: int) -> None:
        blocks = list(blocks)
        ref_cnt = self.pool.ref_cnt
        self.group_used[g] -= sum(1 for b in blocks if ref_cnt[b] == 1)
        self.pool.release(blocks)

    # -- lifetime -----------------------------------------------------------------------------
    def fork(self, parent, child, num_tokens=None) -> None:
        raise NotImplementedError("forked samples are not modelled for KV cache groups "
                                  "(parallel_sampling fanout)")

    def free(self, seq: Sequence) -> None:
        """Release every group's blocks, tail first; a block nobody computed loses its hash
        (PagedKVCacheManager._release says why)."""
        st = self.state.pop(seq.seq_id, None)
        if st is not None:
            pool = self.pool
            first_uncomputed = seq.num_computed_tokens // self.block_size
            for g, table in enumerate(st.tables):
                live = table[st.skipped[g]:]
                if self.enable_prefix_caching and self.kinds[g] != "linear":
                    for i in range(max(first_uncomputed, st.skipped[g]), len(table)):
                        if pool.ref_cnt[table[i]] == 1:
                            pool.uncache(table[i])
                self._release(reversed(live), g)
        seq.block_table = []
        seq.host_table = None
        seq.num_cached_blocks = 0
        self.seqs.pop(seq.seq_id, None)

    def take_copies(self) -> list:
        copies, self.copies = self.copies, []
        return copies

    def swap_out(self, seqs):
        """Not modelled for KV cache groups: None, so the preemption recomputes."""
        return None

    def can_swap_in(self, seqs) -> bool:
        return False

    def swap_in(self, seqs):
        return None

    # -- integrity ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The pool's invariants; every refcount equals the tables holding the block; a block
        belongs to one group and is indexed under it; per group in use as counted; a window
        group's table is nulls then live blocks, at most ceil((window - 1 + tokens of the last
        allocation) / block_size) + 1 of them; a linear group holds one block. Raises
        AssertionError."""
        pool = self.pool
        pool.check()
        holders = [0] * self.num_blocks
        bs = self.block_size
        for sid, st in self.state.items():
            seq = self.seqs[sid]
            live = []
            for g, table in enumerate(st.tables):
                s = st.skipped[g]
                assert all(b == NULL for b in table[:s]), "a live block before a table's skipped end"
                assert all(b != NULL for b in table[s:]), "a null entry among the live blocks"
                for b in table[s:]:
                    holders[b] += 1
                    assert self.block_group[b] == g, f"block {b} held by group {g}, taken by another"
                    live.append(b)
                count = len(table) - s
                if self.kinds[g] == "sliding":
                    bound = _cdiv(self.windows[g] - 1 + st.last_new, bs) + 1
                    assert count <= bound, (
                        f"sequence {sid} holds {count} blocks in window group {g}, more than "
                        f"ceil(({self.windows[g]} - 1 + {st.last_new}) / {bs}) + 1 = {bound}")
                elif self.kinds[g] == "linear":
                    assert count <= 1, f"sequence {sid} holds {count} state blocks in group {g}"
            assert sorted(live) == sorted(seq.block_table), "block_table is not the live blocks"
        assert holders == pool.ref_cnt, "a refcount differs from the tables holding it"
        used = [0] * len(self.kinds)
        for b, r in enumerate(pool.ref_cnt):
            if r:
                used[self.block_group[b]] += 1
        assert used == self.group_used, "blocks in use per group differ from the count"
        for key, b in pool.cached.items():
            assert key[0] == self.block_group[b], "a block indexed under another group"
