"""The block pool: block ids, reference counts, the LRU free queue and the hash index.

Freed blocks that hold a cached hash stay in the free queue and stay hittable until the queue
hands them out again (lazy eviction). The queue (FreeQueue) is an O(1) LRU list: new blocks are
taken from the front, freed blocks are appended at the back, and a free block that a prefix hit
takes back leaves it from wherever it stands.

The index may hold several blocks under one hash (duplicate blocks, as vLLM's
BlockHashToBlockMap in vllm/v1/core/block_pool.py does: two requests that computed the same
tokens each keep their block, since block tables only grow). `cached` maps a hash to the oldest
of its blocks still indexed, the one a lookup returns (vLLM's `get_one_block`: the first of an
insertion-ordered dict); `duplicates` holds the later ones, oldest first, and is empty unless
the KV manager indexes duplicates, so the common path never looks at it. Removing a block
(evicted or uncached) drops only that block; the next oldest takes its place in `cached`.
"""
from __future__ import annotations

from array import array


class FreeQueue:
    """The free blocks, oldest freed first: a list read from a head index, so that taking n
    blocks from the front is one slice.

    Entries are numbered in the order they were appended; `pos[block]` is the number of the
    block's entry while it is queued, and entry k is `q[k - base]` (`base`: entries dropped
    from the front of the list). A block taken back from the middle (`remove`) leaves a dead
    entry behind (its `pos` no longer points there), which the front skips when it reaches it;
    a block freed again is appended anew. The consumed part of the list is dropped when it
    outgrows what is queued (no entry is renumbered unless dead ones are dropped too)."""

    COMPACT_AT = 4096

    def __init__(self, num_blocks: int):
        """Blocks 0..num_blocks-1, all free, in that order."""
        self.q = list(range(num_blocks))
        self.head = 0                # index in q of the oldest entry not yet consumed
        self.base = 0
        self.pos = array("q", range(num_blocks))
        self.size = num_blocks
        self.dead = 0                # dead entries at or after head

    def __len__(self) -> int:
        return self.size

    def __contains__(self, block) -> bool:
        p, q = self.pos[block] - self.base, self.q
        return self.head <= p < len(q) and q[p] == block

    def __iter__(self):
        q, pos = self.q, self.pos
        return (b for k, b in enumerate(q[self.head:], self.base + self.head) if pos[b] == k)

    def front(self, count: int) -> list:
        """The `count` oldest blocks, left queued (the caller checked there are that many)."""
        if not self.dead:
            return self.q[self.head:self.head + count]
        return self._live_from_head(count)[0]

    def pop_front(self, count: int) -> list:
        """Take the `count` oldest blocks (the caller checked there are that many)."""
        head = self.head
        if self.dead:
            blocks, end = self._live_from_head(count)
            self.dead -= end - head - count
        else:
            end = head + count
            blocks = self.q[head:end]
        self.head = end
        self.size -= count
        if end >= self.COMPACT_AT and end > 2 * self.size:
            self._compact()
        return blocks

    def _live_from_head(self, count: int) -> tuple:
        """The first `count` live entries' blocks and the index in q just past the last."""
        q, pos = self.q, self.pos
        blocks = []
        i = self.head
        k = self.base + i
        while len(blocks) < count:
            b = q[i]
            if pos[b] == k:
                blocks.append(b)
            i += 1
            k += 1
        return blocks, i

    def remove(self, block) -> None:
        """Take a queued block out from wherever it stands."""
        self.pos[block] = -1
        self.dead += 1
        self.size -= 1

    def append(self, block) -> None:
        q = self.q
        self.pos[block] = self.base + len(q)
        q.append(block)
        self.size += 1

    def _compact(self) -> None:
        q, head = self.q, self.head
        if not self.dead:
            del q[:head]
            self.base += head
        else:                        # drop the dead entries too: the live ones renumbered
            pos = self.pos
            live = [b for k, b in enumerate(q[head:], self.base + head) if pos[b] == k]
            self.q = live
            self.base = self.dead = 0
            for k, b in enumerate(live):
                pos[b] = k
        self.head = 0


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list = [None] * num_blocks
        self.free_queue = FreeQueue(num_blocks)
        self.cached: dict = {}            # hash -> the oldest block indexed under it
        self.duplicates: dict = {}        # hash -> [later blocks under it, oldest first]
        self.num_cached_free = 0          # free blocks that still hold a hash
        self.num_evictions = 0            # cached blocks reallocated (their hash dropped)
        self.num_removals = 0             # blocks dropped from the index (evicted or uncached)
        self.num_shared_refs = 0          # references beyond the first, over all blocks
        self.num_shared_blocks = 0        # blocks with more than one reference

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def take(self, count: int) -> list:
        """Pop `count` blocks from the front of the free queue (caller checked there are enough)."""
        blocks = self.free_queue.pop_front(count)
        ref_cnt, block_hash = self.ref_cnt, self.block_hash
        if not self.num_cached_free:
            for block in blocks:
                ref_cnt[block] = 1
            return blocks
        cached, duplicates, evicted = self.cached, self.duplicates, 0
        for block in blocks:
            ref_cnt[block] = 1
            h = block_hash[block]
            if h is not None:
                if duplicates:
                    self._unindex(block, h)
                else:             # no duplicates: the block is its hash's only one
                    del cached[h]
                block_hash[block] = None
                evicted += 1
        self.num_cached_free -= evicted
        self.num_evictions += evicted
        self.num_removals += evicted
        return blocks

    def touch(self, blocks) -> None:
        """Take a reference on blocks found in the cache, pulling free ones out of the queue."""
        ref_cnt = self.ref_cnt
        for block in blocks:
            if ref_cnt[block] == 0:
                self.free_queue.remove(block)
                self.num_cached_free -= 1
            else:
                self.num_shared_refs += 1
                if ref_cnt[block] == 1:
                    self.num_shared_blocks += 1
            ref_cnt[block] += 1

    def release(self, blocks_in_eviction_order) -> None:
        """Drop one reference on each block; those that reach zero join the back of the queue."""
        ref_cnt, block_hash = self.ref_cnt, self.block_hash
        queue = self.free_queue
        q, pos = queue.q, queue.pos
        if not self.num_shared_blocks:
            # No block has a second reference, so every one of these is freed: the loop
            # below without its tests (tests/test_fast_parts.py compares the pool with a plain one).
            blocks = list(blocks_in_eviction_order)
            hashed = 0
            for k, block in enumerate(blocks, queue.base + len(q)):
                ref_cnt[block] = 0
                pos[block] = k
                if block_hash[block] is not None:
                    hashed += 1
            q.extend(blocks)
            queue.size += len(blocks)
            self.num_cached_free += hashed
            return
        base = queue.base
        shared_refs = shared_blocks = cached_free = freed = 0
        for block in blocks_in_eviction_order:
            refs = ref_cnt[block] - 1
            ref_cnt[block] = refs
            if refs > 0:
                shared_refs += 1
                if refs == 1:
                    shared_blocks += 1
            elif refs == 0:       # queue.append, inlined
                pos[block] = base + len(q)
                q.append(block)
                freed += 1
                if block_hash[block] is not None:
                    cached_free += 1
        queue.size += freed
        self.num_shared_refs -= shared_refs
        self.num_shared_blocks -= shared_blocks
        self.num_cached_free += cached_free

    def add_refs(self, block: int, extra: int) -> None:
        """`extra` more references on an in-use block (tables swapped in together)."""
        if self.ref_cnt[block] == 1 and extra > 0:
            self.num_shared_blocks += 1
        self.ref_cnt[block] += extra
        self.num_shared_refs += extra

    def count_free_among(self, blocks) -> int:
        """How many of `blocks` sit in the free queue (touching them would shrink it)."""
        ref_cnt = self.ref_cnt
        return sum(1 for b in blocks if ref_cnt[b] == 0)

    def cache(self, block: int, block_hash, duplicate: bool = False) -> None:
        """Register a full, in-use block under its hash. A hash already indexed keeps its block
        and this one stays unregistered (first writer wins), unless `duplicate`: then it is
        indexed too, behind the others (the KV manager inlines this in _cache_full_blocks)."""
        if self.block_hash[block] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
        elif duplicate:
            self.duplicates.setdefault(block_hash, []).append(block)
        else:
            return
        self.block_hash[block] = block_hash

    def uncache(self, block: int) -> None:
        """Drop an in-use block's hash from the index (its contents will not be computed)."""
        h = self.block_hash[block]
        if h is not None:
            self._unindex(block, h)
            self.block_hash[block] = None
            self.num_removals += 1

    def _unindex(self, block: int, h) -> None:
        """Take `block` out of the index under its hash `h`; the hash's next oldest block, if
        any, becomes the one lookups return (vLLM's BlockHashToBlockMap.pop)."""
        later = self.duplicates.get(h)
        if self.cached[h] != block:
            later.remove(block)
        elif later:
            self.cached[h] = later.pop(0)
        else:
            del self.cached[h]
        if later is not None and not later:
            del self.duplicates[h]

    def lookup(self, block_hash):
        """The block a prefix lookup hits for `block_hash` (the oldest indexed), or None."""
        return self.cached.get(block_hash)

    def blocks_of(self, block_hash) -> list:
        """Every block indexed under `block_hash`, oldest first."""
        first = self.cached.get(block_hash)
        return [] if first is None else [first] + self.duplicates.get(block_hash, [])

    def check(self) -> None:
        """Assert the pool's own invariants (the manager checks the refcounts against tables)."""
        n = self.num_blocks
        assert all(self.ref_cnt[b] == 0 for b in self.free_queue), "a free block has references"
        assert sum(1 for r in self.ref_cnt if r == 0) == len(self.free_queue), "free queue count"
        assert all(r >= 0 for r in self.ref_cnt), "negative refcount"
        assert self.num_shared_refs == sum(r - 1 for r in self.ref_cnt if r > 1), \
            "shared-reference count"
        assert self.num_shared_blocks == sum(1 for r in self.ref_cnt if r > 1), \
            "shared-block count"
        assert len(self.free_queue) + sum(1 for r in self.ref_cnt if r > 0) == n
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"hash index points at block {b} with another hash"
        for h, later in self.duplicates.items():
            assert later and h in self.cached, f"duplicates of hash {h} without a first block"
            assert all(self.block_hash[b] == h for b in later), "a duplicate with another hash"
        indexed = len(self.cached) + sum(len(later) for later in self.duplicates.values())
        assert sum(1 for h in self.block_hash if h is not None) == indexed, \
            "a hashed block missing from the index, or one indexed twice"
        assert self.num_cached_free == sum(
            1 for b in self.free_queue if self.block_hash[b] is not None), "cached-free count"
