"""Duplicate block hashes: several blocks indexed under one hash (cache.duplicate_blocks, on
under semantics vllm-0.26), as vLLM v0.26 keeps them.

vLLM v0.26, vllm/v1/core/block_pool.py: `BlockHashToBlockMap` maps a hash to one block or to an
insertion-ordered {block_id: block} dict. `insert` adds a block under a hash already present
(cache_full_blocks does not de-duplicate: block tables are append-only); `get_one_block`
returns the first of the dict, i.e. the oldest block still indexed (BlockPool.get_cached_block:
"If there are duplicated blocks, we return the first block in the cache"); `pop(key, block_id)`
removes that one block and keeps the others (BlockPool._maybe_evict_cached_block, when
get_new_blocks reuses a free block).

Conventions as tests/test_kv_manager.py: block size 16, prefix identities as trace ids at 16
tokens per id, a pool of 8 blocks handed out lowest id first.

The duplicate in every test: A (48 tokens, ids 0 1 2) prefills its first 16 tokens (block 0);
B, the same prompt, hits block 0 and computes blocks 1 and 2 itself; then A computes its
tokens 16..47 into blocks 3 and 4, whose hashes B's blocks 1 and 2 already hold.
"""
from simkv.engine.kv.block_pool import BlockPool
from simkv.engine.kv.paged import PagedKVCacheManager
from tests.test_kv_manager import admit, make_request, make_seq
from tests.test_kv_state_machine import SETTINGS, PagedKVMachine

BS = 16
IDS = (0, 1, 2)


def two_copies(duplicate_blocks=True):
    """(kv, a, b) after the duplicate is made: a holds [0, 3, 4], b holds [0, 1, 2]."""
    kv = PagedKVCacheManager(8, BS, duplicate_blocks=duplicate_blocks)
    a = make_seq(make_request(0, 48, ids=IDS))
    b = make_seq(make_request(1, 48, ids=IDS))
    assert admit(kv, a, num_new=16) == 0
    assert admit(kv, b) == 16                      # block 0 hit, 1 and 2 its own
    assert kv.allocate_slots(a, 32)                # A's next chunk: tokens 16..47
    a.num_computed_tokens = 48
    assert a.block_table == [0, 3, 4] and b.block_table == [0, 1, 2]
    kv.check_integrity()
    return kv, a, b


def fill(kv, blocks, rid=9):
    """Another request takes `blocks` blocks off the front of the free queue (evicting)."""
    seq = make_seq(make_request(rid, blocks * BS))
    assert kv.allocate_slots(seq, blocks * BS)
    seq.num_computed_tokens = blocks * BS


def third(kv, rid=2):
    """A third request with the same 48 tokens and 16 more: up to 3 blocks can hit."""
    return make_seq(make_request(rid, 64, ids=IDS + (9,)))


def test_a_block_computed_under_an_indexed_hash_is_indexed_too():
    kv, a, b = two_copies()
    h1, h2 = b.block_hashes[1], b.block_hashes[2]
    assert a.block_hashes[:3] == b.block_hashes[:3]
    assert kv.pool.blocks_of(h1) == [1, 3] and kv.pool.blocks_of(h2) == [2, 4]
    assert kv.pool.block_hash[3] == h1 and kv.pool.block_hash[4] == h2


def test_a_lookup_returns_the_oldest_block_of_a_hash():
    kv, _, _ = two_copies()
    assert kv.prefix_lookup(third(kv)) == ([0, 1, 2], 48)


def test_evicting_the_first_block_of_a_hash_leaves_the_later_one_hittable():
    kv, _, b = two_copies()
    kv.free(b)              # 1 and 2 join the queue (tail first) behind 5, 6, 7; 0 is A's too
    assert list(kv.pool.free_queue) == [5, 6, 7, 2, 1]
    fill(kv, 5)             # reuses 5, 6, 7, then evicts 2 and 1
    kv.check_integrity()
    assert kv.prefix_lookup(third(kv)) == ([0, 3, 4], 48)


def test_without_duplicate_blocks_the_second_copy_is_never_indexed():
    """semantics vllm-0.18 (simkv before issue 24): first writer wins."""
    kv, a, b = two_copies(duplicate_blocks=False)
    assert kv.pool.block_hash[3] is None and kv.pool.block_hash[4] is None
    kv.free(b)
    fill(kv, 5)
    assert kv.prefix_lookup(third(kv)) == ([0], 16)


def test_evicting_a_later_block_of_a_hash_leaves_the_first():
    kv, a, _ = two_copies()
    kv.free(a)              # 4 and 3 join the queue; 0 is B's too
    fill(kv, 5)             # 5, 6, 7, then A's 4 and 3
    kv.check_integrity()
    assert kv.pool.blocks_of(kv.pool.block_hash[1]) == [1]
    assert kv.prefix_lookup(third(kv)) == ([0, 1, 2], 48)


def test_a_repeated_lookup_sees_the_hit_block_replaced_by_its_duplicate():
    """The KV manager keeps its last lookup while no block leaves the index: evicting a hash's
    first block while a duplicate keeps the hash indexed is such a removal (the hit it gave
    is a block that now holds other tokens)."""
    kv, _, b = two_copies()
    c = third(kv)
    assert kv.prefix_lookup(c) == ([0, 1, 2], 48)
    kv.free(b)
    fill(kv, 4)             # 5, 6, 7, then block 2 only; its hash stays indexed through 4
    assert kv.prefix_lookup(c) == ([0, 1, 4], 48)


def test_a_hit_block_is_not_indexed_again():
    """vLLM's _insert_block_hash returns when the block already holds the hash."""
    kv, _, _ = two_copies()
    c = third(kv)
    assert admit(kv, c) == 48
    assert c.block_table[:3] == [0, 1, 2]
    kv.check_integrity()      # a block indexed twice fails the count of indexed blocks
    assert kv.pool.blocks_of(kv.pool.block_hash[1]) == [1, 3]


def test_blocks_of_one_hash_are_returned_in_insertion_order_as_each_is_evicted():
    """Three blocks under one hash, taken out oldest, newest, middle: a lookup always gives
    the oldest still indexed (the first key of vLLM's insertion-ordered dict)."""
    pool = BlockPool(6)
    assert pool.take(3) == [0, 1, 2]
    for block in (0, 1, 2):
        pool.cache(block, "h", duplicate=True)
    assert pool.lookup("h") == 0 and pool.blocks_of("h") == [0, 1, 2]
    pool.uncache(0)
    assert pool.lookup("h") == 1
    pool.uncache(2)
    assert pool.blocks_of("h") == [1]
    pool.take(3)                            # 3, 4, 5: another block under the hash
    pool.cache(3, "h", duplicate=True)
    assert pool.blocks_of("h") == [1, 3]
    pool.uncache(1)
    assert pool.lookup("h") == 3
    pool.uncache(3)
    assert pool.lookup("h") is None and pool.duplicates == {}
    assert pool.num_removals == 4
    pool.check()


def test_without_duplicates_cache_keeps_the_first_writer():
    pool = BlockPool(2)
    pool.take(2)
    pool.cache(0, "h")
    pool.cache(1, "h")
    assert pool.blocks_of("h") == [0] and pool.block_hash[1] is None
    pool.check()


class DuplicateBlocksMachine(PagedKVMachine):
    """tests/test_kv_state_machine.py's machine (its content oracle: every live sequence finds
    its own tokens in its table) with duplicate blocks indexed."""

    def __init__(self):
        super().__init__()
        self.kv = PagedKVCacheManager(self.kv.num_blocks, self.kv.block_size,
                                      self.enable_prefix_caching, watermark=self.watermark,
                                      num_host_blocks=self.kv.host.num_blocks,
                                      duplicate_blocks=True)


TestDuplicateBlocks = DuplicateBlocksMachine.TestCase
TestDuplicateBlocks.settings = SETTINGS
