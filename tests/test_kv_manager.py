"""The paged KV cache manager, behaviour by behaviour (issue 3), with numbers checkable by hand.

Conventions: block size 16; a prompt of P tokens is "computed" right after its slots are
allocated (the manager has no notion of time); prefix identities are trace ids at 16 tokens per
id, so ids (0, 1, 2, ...) shared by two prompts mean their first tokens are equal.
"""
import pytest

from simkv.engine.kv.hashing import hash_root
from simkv.engine.kv.paged import PagedKVCacheManager
from simkv.engine.request import Request, Sequence

BS = 16


def make_request(rid, prompt, *, ids=None, output=8, n=1, tenant="", adapter="", mm_key="",
                 global_scope=False):
    req = Request(rid, 0.0, prompt, output, n=n, prefix_ids=tuple(ids) if ids else None,
                  prefix_block_tokens=BS if ids else 0, tenant=tenant, adapter=adapter,
                  mm_key=mm_key)
    req.hash_root = hash_root(req, global_scope)
    return req


def make_seq(req, seq_id=None, sample=0):
    seq = Sequence(req.request_id if seq_id is None else seq_id, req, sample, req.prompt_tokens)
    req.seqs.append(seq)
    req.all_seqs.append(seq)
    return seq


def admit(kv, seq, num_new=None, admission=True):
    """Look up the prefix cache and allocate the rest of the prompt (or `num_new` tokens);
    on success the tokens count as computed. Returns the cached tokens, or None on failure."""
    hits, cached = kv.prefix_lookup(seq)
    if num_new is None:
        num_new = seq.num_tokens - cached
    if not kv.allocate_slots(seq, num_new, hits, admission=admission):
        return None
    seq.num_computed_tokens += cached + num_new
    return cached


def finish_prompt(seq):
    """The step that computed the last prompt token samples one token."""
    assert seq.num_computed_tokens == seq.num_tokens
    seq.num_tokens += 1


def append(kv, seq):
    """Decode one token: slots for the sampled token, then it is computed and another sampled."""
    ok = kv.allocate_slots(seq, 1)
    if ok:
        seq.num_computed_tokens += 1
        seq.num_tokens += 1
    return ok


def fork(kv, parent, seq_id):
    child = Sequence(seq_id, parent.request, len(parent.request.all_seqs), parent.num_tokens,
                     num_computed_tokens=parent.num_computed_tokens)
    parent.request.seqs.append(child)
    parent.request.all_seqs.append(child)
    kv.fork(parent, child)
    return child


def snapshot(kv):
    pool = kv.pool
    return (list(pool.ref_cnt), list(pool.free_queue), dict(pool.cached), list(pool.block_hash),
            pool.num_cached_free, list(kv.host.ref_cnt), list(kv.host.free), list(kv.copies),
            {sid: (list(s.block_table), list(s.host_table or ())) for sid, s in kv.seqs.items()})


def take_all(kv):
    """Blocks in the order the free queue hands them out (eviction order)."""
    return kv.pool.take(kv.num_free_blocks)


# --- allocation and prefix caching -----------------------------------------------------------

def test_55_token_prompt_takes_4_blocks_and_hashes_the_first_3():
    kv = PagedKVCacheManager(num_blocks=10, block_size=BS)
    seq = make_seq(make_request(1, 55, ids=[0, 1, 2, 3]))
    assert admit(kv, seq) == 0
    assert seq.block_table == [0, 1, 2, 3]
    assert [kv.pool.block_hash[b] is not None for b in seq.block_table] == \
        [True, True, True, False]
    assert len(kv.pool.cached) == 3 and seq.num_cached_blocks == 3
    assert kv.num_free_blocks == 6
    kv.check_integrity()


def test_second_prompt_sharing_48_tokens_hits_exactly_those_3_blocks():
    kv = PagedKVCacheManager(num_blocks=10, block_size=BS)
    a = make_seq(make_request(1, 55, ids=[0, 1, 2, 3]))
    admit(kv, a)
    b = make_seq(make_request(2, 60, ids=[0, 1, 2, 9]))
    hits, tokens = kv.prefix_lookup(b)
    assert list(hits) == a.block_table[:3] and tokens == 48
    assert admit(kv, b) == 48
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] not in a.block_table
    assert [kv.pool.ref_cnt[blk] for blk in a.block_table] == [2, 2, 2, 1]
    kv.check_integrity()


def test_after_both_are_freed_eviction_is_tail_first_then_lru():
    kv = PagedKVCacheManager(num_blocks=6, block_size=BS)
    a = make_seq(make_request(1, 55, ids=[0, 1, 2, 3]))
    admit(kv, a)                                   # blocks 0 1 2 3
    b = make_seq(make_request(2, 60, ids=[0, 1, 2, 9]))
    admit(kv, b)                                   # hits 0 1 2, new block 4
    assert b.block_table == [0, 1, 2, 4]
    kv.free(a)                                     # only a's private tail 3 becomes free
    kv.free(b)                                     # then b's tail 4, then the shared 2 1 0
    kv.check_integrity()
    assert kv.num_free_blocks == 6 and kv.num_cached_free_blocks == 3
    # never-used block 5 first, then the older tail, the newer tail, the prefix from its end
    assert take_all(kv) == [5, 3, 4, 2, 1, 0]


def test_freed_cached_blocks_stay_hittable_until_reallocated():
    kv = PagedKVCacheManager(num_blocks=4, block_size=BS)
    a = make_seq(make_request(1, 64, ids=[0, 1, 2, 3]))
    admit(kv, a)
    kv.free(a)
    assert kv.num_cached_free_blocks == 4
    again = make_seq(make_request(2, 64, ids=[0, 1, 2, 3]))
    hits, tokens = kv.prefix_lookup(again)
    assert list(hits) == [0, 1, 2] and tokens == 48
    other = make_seq(make_request(3, 64))          # no shared identity: takes all 4 blocks
    admit(kv, other)
    assert kv.prefix_lookup(again) == ([], 0) and kv.pool.num_evictions == 4


def test_a_hit_leaves_at_least_one_prompt_token_to_compute():
    kv = PagedKVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make_seq(make_request(1, 48, ids=[0, 1, 2])))
    same = make_seq(make_request(2, 48, ids=[0, 1, 2]))
    hits, tokens = kv.prefix_lookup(same)
    assert len(hits) == 2 and tokens == 32        # not 3 blocks: the last token is computed
    assert admit(kv, same) == 32 and len(same.block_table) == 3


def test_identical_prompts_admitted_in_the_same_step_share_blocks():
    kv = PagedKVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq(make_request(1, 40, ids=[0, 1, 2]))
    assert kv.allocate_slots(a, 40, admission=True)   # not computed yet: the same step
    b = make_seq(make_request(2, 40, ids=[0, 1, 2]))
    hits, tokens = kv.prefix_lookup(b)
    assert list(hits) == a.block_table[:2] and tokens == 32


def test_failed_allocation_changes_nothing():
    kv = PagedKVCacheManager(num_blocks=6, block_size=BS)
    a = make_seq(make_request(1, 48, ids=[0, 1, 2]))
    admit(kv, a)
    kv.free(a)                                     # 3 cached-free blocks
    b = make_seq(make_request(2, 17))
    admit(kv, b)                                   # 2 blocks, 1 left that was never used
    before = snapshot(kv)
    c = make_seq(make_request(3, 80, ids=[0, 1, 2, 7, 8]))   # hits 3 blocks, needs 2 more
    hits, tokens = kv.prefix_lookup(c)
    assert len(hits) == 3
    assert not kv.allocate_slots(c, 80 - tokens, hits, admission=True)
    assert snapshot(kv) == before
    assert c.block_table == [] and c.num_cached_blocks == 0
    kv.check_integrity()


def test_failed_copy_on_write_append_changes_nothing():
    kv = PagedKVCacheManager(num_blocks=2, block_size=BS)
    parent = make_seq(make_request(1, 20, n=2))
    admit(kv, parent)                              # 2 blocks, the tail holds 4 tokens
    finish_prompt(parent)
    fork(kv, parent, 10)
    before = snapshot(kv)
    assert not append(kv, parent)                  # the copy needs a block; none is free
    assert snapshot(kv) == before
    kv.check_integrity()


def test_a_hit_block_is_never_evicted_to_serve_its_own_request():
    kv = PagedKVCacheManager(num_blocks=5, block_size=BS)
    a = make_seq(make_request(1, 64, ids=[0, 1, 2, 3]))
    admit(kv, a)                                   # blocks 0 1 2 3
    c = make_seq(make_request(2, 16))
    admit(kv, c)                                   # block 4
    kv.free(a)                                     # free queue: 3 2 1 0, all cached
    b = make_seq(make_request(3, 80, ids=[0, 1, 2, 3, 4]))
    hits, _ = kv.prefix_lookup(b)
    assert list(hits) == [0, 1, 2, 3]
    # b needs one block beyond its 4 hits; the only free blocks are the hits themselves
    assert not kv.allocate_slots(b, 16, hits, admission=True)
    assert kv.prefix_lookup(b)[0] == [0, 1, 2, 3]
    kv.free(c)                                     # queue: 3 2 1 0 4
    assert kv.allocate_slots(b, 16, hits, admission=True)
    assert b.block_table == [0, 1, 2, 3, 4]        # took 4, not the LRU-first hit 3
    kv.check_integrity()


def test_watermark_blocks_admission_but_not_growth():
    kv = PagedKVCacheManager(num_blocks=10, block_size=BS, watermark=0.2)   # 2 blocks reserved
    assert kv.max_admissible_blocks() == 8
    big = make_seq(make_request(1, 9 * BS))
    assert admit(kv, big) is None and kv.num_free_blocks == 10
    fits = make_seq(make_request(2, 8 * BS))
    assert admit(kv, fits) == 0 and kv.num_free_blocks == 2
    assert not kv.allocate_slots(make_seq(make_request(3, 1)), 1, admission=True)
    finish_prompt(fits)
    assert append(kv, fits) and kv.num_free_blocks == 1    # growth may dip into the reserve


# --- forks and copy-on-write -----------------------------------------------------------------

def test_fork_allocates_nothing_and_shares_every_block():
    kv = PagedKVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq(make_request(1, 40, n=3))
    admit(kv, parent)
    finish_prompt(parent)
    free_before = kv.num_free_blocks
    children = [fork(kv, parent, 10), fork(kv, parent, 11)]
    assert kv.num_free_blocks == free_before
    assert all(c.block_table == parent.block_table for c in children)
    assert [kv.pool.ref_cnt[b] for b in parent.block_table] == [3, 3, 3]
    assert kv.take_copies() == []
    kv.check_integrity()


@pytest.mark.parametrize("seq_len, copies", [(32, 0), (33, 1), (40, 1), (47, 1), (48, 0)])
def test_append_after_fork_copies_a_block_iff_seq_len_is_not_a_block_multiple(seq_len, copies):
    kv = PagedKVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq(make_request(1, seq_len, n=2))
    admit(kv, parent)
    finish_prompt(parent)
    fork(kv, parent, 10)
    tail = parent.block_table[-1]
    assert append(kv, parent)
    recorded = kv.take_copies()
    assert len(recorded) == copies and kv.num_cow_copies == copies
    if copies:                                    # only the shared partial tail is copied
        assert recorded == [(tail, parent.block_table[-1])]
    kv.check_integrity()


def test_the_last_holder_of_a_shared_tail_writes_in_place():
    kv = PagedKVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq(make_request(1, 40, n=3))
    admit(kv, parent)
    finish_prompt(parent)
    c1, c2 = fork(kv, parent, 10), fork(kv, parent, 11)
    tail = parent.block_table[-1]
    for seq in (parent, c1, c2):
        assert append(kv, seq)
    assert len(kv.take_copies()) == 2             # n - 1 copies for n samples
    assert c2.block_table[-1] == tail and parent.block_table[-1] != c1.block_table[-1] != tail
    assert parent.block_table[:2] == c1.block_table[:2] == c2.block_table[:2]
    kv.check_integrity()


# --- isolation -------------------------------------------------------------------------------

@pytest.mark.parametrize("first, second", [
    ({"tenant": "a"}, {"tenant": "b"}),
    ({"adapter": "lora-1"}, {"adapter": "lora-2"}),
    ({"adapter": "lora-1"}, {}),
    ({"mm_key": "image-1"}, {"mm_key": "image-2"}),
])
def test_different_salts_tenants_adapters_never_hit_each_other(first, second):
    kv = PagedKVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_seq(make_request(1, 64, ids=[0, 1, 2, 3], **first)))
    other = make_seq(make_request(2, 64, ids=[0, 1, 2, 3], **second))
    assert kv.prefix_lookup(other) == ([], 0)
    same = make_seq(make_request(3, 64, ids=[0, 1, 2, 3], **first))
    assert kv.prefix_lookup(same)[1] == 48


def test_global_prefix_scope_lets_tenants_share_but_not_adapters():
    kv = PagedKVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_seq(make_request(1, 64, ids=[0, 1, 2, 3], tenant="a", global_scope=True)))
    tenant_b = make_seq(make_request(2, 64, ids=[0, 1, 2, 3], tenant="b", global_scope=True))
    assert kv.prefix_lookup(tenant_b)[1] == 48
    adapter = make_seq(make_request(3, 64, ids=[0, 1, 2, 3], tenant="b", adapter="x",
                                    global_scope=True))
    assert kv.prefix_lookup(adapter) == ([], 0)


def test_prompts_without_identity_never_share():
    kv = PagedKVCacheManager(num_blocks=16, block_size=BS)
    admit(kv, make_seq(make_request(1, 64)))
    assert kv.prefix_lookup(make_seq(make_request(2, 64))) == ([], 0)


def test_prefix_caching_off_never_hits_or_hashes():
    kv = PagedKVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    admit(kv, make_seq(make_request(1, 64, ids=[0, 1, 2, 3])))
    assert kv.pool.cached == {}
    assert kv.prefix_lookup(make_seq(make_request(2, 64, ids=[0, 1, 2, 3]))) == ((), 0)


# --- swap ------------------------------------------------------------------------------------

def test_swap_out_then_in_restores_the_tables_and_the_free_counts():
    kv = PagedKVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=4)
    parent = make_seq(make_request(1, 40, n=2))
    admit(kv, parent)
    finish_prompt(parent)
    child = fork(kv, parent, 10)
    assert append(kv, parent)                      # parent: 0 1 3 (copied tail), child: 0 1 2
    kv.take_copies()
    old = {s.seq_id: list(s.block_table) for s in (parent, child)}
    free_before, host_free_before = kv.num_free_blocks, len(kv.host.free)

    out = dict(kv.swap_out([parent, child]))       # device -> host, shared blocks once
    assert sorted(out) == [0, 1, 2, 3] and len(set(out.values())) == 4
    assert kv.num_free_blocks == 8 and len(kv.host.free) == host_free_before - 4
    for seq in (parent, child):
        assert seq.block_table == [] and seq.host_table == [out[b] for b in old[seq.seq_id]]
    kv.check_integrity()

    back = dict(kv.swap_in([parent, child]))       # host -> device
    for seq in (parent, child):                    # each position holds the same content
        assert seq.block_table == [back[out[b]] for b in old[seq.seq_id]]
        assert seq.host_table is None
    assert parent.block_table[:2] == child.block_table[:2]   # still shared, refcount 2
    assert [kv.pool.ref_cnt[b] for b in child.block_table] == [2, 2, 1]
    assert kv.num_free_blocks == free_before and len(kv.host.free) == host_free_before
    assert kv.swapped_out_blocks == kv.swapped_in_blocks == 4
    kv.check_integrity()


def test_swap_out_returns_none_and_changes_nothing_when_the_host_pool_is_full():
    kv = PagedKVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=2)
    seq = make_seq(make_request(1, 40))
    admit(kv, seq)
    before = snapshot(kv)
    assert kv.swap_out([seq]) is None
    assert snapshot(kv) == before and seq.host_table is None


def test_swap_in_returns_none_and_changes_nothing_when_device_blocks_are_short():
    kv = PagedKVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=4)
    seq = make_seq(make_request(1, 40))
    admit(kv, seq)
    kv.swap_out([seq])
    admit(kv, make_seq(make_request(2, 32)))       # 2 of 4 blocks left; seq needs 3
    before = snapshot(kv)
    assert kv.swap_in([seq]) is None
    assert snapshot(kv) == before


def test_swapped_in_blocks_are_hittable_again():
    kv = PagedKVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=4)
    seq = make_seq(make_request(1, 48, ids=[0, 1, 2]))
    admit(kv, seq)
    kv.swap_out([seq])
    admit(kv, make_seq(make_request(2, 64)))       # evicts every cached block
    kv.free(kv.seqs[2])
    kv.swap_in([seq])
    assert kv.prefix_lookup(make_seq(make_request(3, 48, ids=[0, 1, 2])))[1] == 32


def test_free_releases_host_blocks_of_a_swapped_sequence():
    kv = PagedKVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=4)
    seq = make_seq(make_request(1, 40))
    admit(kv, seq)
    kv.swap_out([seq])
    kv.free(seq)
    assert len(kv.host.free) == 4 and kv.seqs == {}
    kv.check_integrity()


# --- integrity check -------------------------------------------------------------------------

def test_integrity_check_catches_a_refcount_that_differs_from_the_tables():
    kv = PagedKVCacheManager(num_blocks=4, block_size=BS)
    seq = make_seq(make_request(1, 20))
    admit(kv, seq)
    kv.pool.ref_cnt[seq.block_table[0]] += 1
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_integrity_check_catches_a_stale_hash_index_entry():
    kv = PagedKVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, make_seq(make_request(1, 20, ids=[0, 1])))
    kv.pool.block_hash[0] = None                   # index still points at block 0
    with pytest.raises(AssertionError):
        kv.check_integrity()
