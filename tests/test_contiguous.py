"""The contiguous-slab baseline: each sequence reserves max_model_len tokens in one range (issue 3).

Numbers: block size 16, max_model_len 64, so a slab is 4 blocks.
"""
from simkv.engine.kv.contiguous import ContiguousKVCacheManager
from simkv.engine.request import Request, Sequence
from simkv.engine.scheduler import Scheduler

BS = 16


def make_seq(rid, prompt, seq_id=None, n=1):
    req = Request(rid, 0.0, prompt, 8, n=n)
    seq = Sequence(rid if seq_id is None else seq_id, req, 0, prompt)
    req.seqs.append(seq)
    req.all_seqs.append(seq)
    return seq


def admit(kv, seq):
    ok = kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens, admission=True)
    if ok:
        seq.num_computed_tokens = seq.num_tokens
    return ok


def child_of(parent, seq_id):
    child = Sequence(seq_id, parent.request, 1, parent.num_tokens,
                     num_computed_tokens=parent.num_computed_tokens)
    parent.request.seqs.append(child)
    return child


def test_each_sequence_reserves_max_model_len_up_front():
    kv = ContiguousKVCacheManager(num_blocks=12, block_size=BS, max_model_len=64)
    seq = make_seq(1, 20)
    assert admit(kv, seq)
    assert kv.reservations[1] == (0, 4) and kv.num_used_blocks == 4 and kv.num_free_blocks == 8
    assert seq.block_table == [0, 1]               # the blocks holding tokens, inside the slab
    assert kv.seq_slots(seq) == 64
    assert kv.blocks_needed(20, n=3) == 12
    kv.check_integrity()


def test_growth_stays_inside_the_slab_and_fails_past_it():
    kv = ContiguousKVCacheManager(num_blocks=12, block_size=BS, max_model_len=64)
    seq = make_seq(1, 60)
    assert admit(kv, seq)
    assert kv.allocate_slots(seq, 4) and seq.block_table == [0, 1, 2, 3]
    seq.num_computed_tokens = 64
    assert not kv.allocate_slots(seq, 1)
    assert kv.num_used_blocks == 4


def test_reservations_are_first_fit():
    kv = ContiguousKVCacheManager(num_blocks=12, block_size=BS, max_model_len=64)
    a, b, c = make_seq(1, 10), make_seq(2, 10), make_seq(3, 10)
    for seq in (a, b, c):
        assert admit(kv, seq)
    assert [kv.reservations[i][0] for i in (1, 2, 3)] == [0, 4, 8]
    kv.free(a)
    kv.free(c)
    d = make_seq(4, 10)
    assert admit(kv, d) and kv.reservations[4] == (0, 4)   # the first hole, not the last
    kv.check_integrity()


def test_freed_ranges_merge_with_their_neighbours():
    kv = ContiguousKVCacheManager(num_blocks=12, block_size=BS, max_model_len=64)
    seqs = [make_seq(i, 10) for i in range(3)]
    for seq in seqs:
        admit(kv, seq)
    for seq in (seqs[0], seqs[2], seqs[1]):
        kv.free(seq)
    assert kv.free_ranges == [(0, 12)]
    kv.check_integrity()


def test_reservation_waste_counts_the_unused_part_of_each_slab():
    kv = ContiguousKVCacheManager(num_blocks=12, block_size=BS, max_model_len=64)
    seq = make_seq(1, 20)
    admit(kv, seq)
    # 64 reserved slots hold 20 tokens: 44 wasted, where paging would hold 2 blocks (12 wasted)
    assert kv.seq_slots(seq) - seq.num_computed_tokens == 44


def test_external_fragmentation_is_free_space_no_reservation_can_use():
    kv = ContiguousKVCacheManager(num_blocks=10, block_size=BS, max_model_len=64)
    a, b = make_seq(1, 10), make_seq(2, 10)
    admit(kv, a)
    admit(kv, b)
    # 2 blocks are free but too few for a 4-block slab: a new request cannot be admitted
    assert kv.num_free_blocks == 2 and kv.external_fragmentation() == 0.2
    assert not admit(kv, make_seq(3, 10))
    kv.free(a)
    assert kv.external_fragmentation() == 0.2      # the 4-block hole is usable, the tail is not


def test_watermark_blocks_admission():
    kv = ContiguousKVCacheManager(num_blocks=10, block_size=BS, max_model_len=64, watermark=0.3)
    assert admit(kv, make_seq(1, 10))              # 6 free afterwards, 3 kept
    assert not admit(kv, make_seq(2, 10))          # would leave 2 < 3
    assert kv.num_used_blocks == 4


def test_fork_reserves_a_slab_and_copies_every_used_block():
    kv = ContiguousKVCacheManager(num_blocks=12, block_size=BS, max_model_len=64)
    parent = make_seq(1, 40, n=2)
    admit(kv, parent)                              # blocks 0 1 2
    child = child_of(parent, 10)
    kv.fork(parent, child)
    assert kv.reservations[10] == (4, 4) and child.block_table == [4, 5, 6]
    assert kv.take_copies() == [(0, 4), (1, 5), (2, 6)]
    assert kv.num_cow_copies == 3 and kv.num_used_blocks == 8
    kv.check_integrity()


def test_fork_without_room_copies_when_the_child_first_gets_a_slab():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=BS, max_model_len=64)
    parent = make_seq(1, 20, n=2)
    admit(kv, parent)                              # slab 0..3, blocks 0 1
    other = make_seq(2, 10)
    admit(kv, other)                               # slab 4..7: the pool is full
    child = child_of(parent, 10)
    kv.fork(parent, child)
    assert child.block_table == [] and kv.take_copies() == []
    assert not kv.allocate_slots(child, 1)         # still no slab: the scheduler preempts
    kv.free(other)
    assert kv.allocate_slots(child, 1)
    assert child.block_table == [4, 5] and kv.take_copies() == [(0, 4), (1, 5)]
    kv.check_integrity()


def test_a_child_waiting_for_a_slab_takes_over_its_parents_slab_when_the_parent_is_freed():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=BS, max_model_len=64)
    parent = make_seq(1, 20, n=3)
    admit(kv, parent)
    admit(kv, make_seq(2, 10))                     # the pool is full
    first, second = child_of(parent, 10), child_of(parent, 11)
    kv.fork(parent, first)
    kv.fork(parent, second)
    kv.free(parent)                                # e.g. sample 0 finished first
    assert kv.reservations[10] == (0, 4) and first.block_table == [0, 1]
    assert kv.take_copies() == [] and kv.num_used_blocks == 8
    kv.free(kv.seqs[2])
    assert kv.allocate_slots(second, 1)            # now copies from the first child
    assert kv.take_copies() == [(0, 4), (1, 5)]
    kv.check_integrity()


def test_swap_out_and_in_moves_the_used_blocks_through_host_memory():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=BS, max_model_len=64,
                                  num_host_blocks=4)
    seq = make_seq(1, 40)
    admit(kv, seq)
    out = kv.swap_out([seq])
    assert out == [(0, 0), (1, 1), (2, 2)] and kv.num_used_blocks == 0
    assert len(kv.host.free) == 1
    admit(kv, make_seq(2, 10))                     # takes slab 0..3
    back = kv.swap_in([seq])
    assert back == [(0, 4), (1, 5), (2, 6)] and seq.block_table == [4, 5, 6]
    assert len(kv.host.free) == 4 and kv.swapped_out_blocks == kv.swapped_in_blocks == 3
    kv.check_integrity()


def test_swap_out_refuses_a_request_whose_fork_found_no_slab():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=BS, max_model_len=64,
                                  num_host_blocks=16)
    parent = make_seq(1, 20, n=2)
    admit(kv, parent)
    admit(kv, make_seq(2, 10))
    child = child_of(parent, 10)
    kv.fork(parent, child)
    assert kv.swap_out([parent, child]) is None    # recompute instead; nothing moved
    assert parent.host_table is None and kv.reservations[1] == (0, 4)
    assert len(kv.host.free) == 16
    kv.check_integrity()


def test_swap_out_returns_none_when_the_host_pool_is_full():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=BS, max_model_len=64,
                                  num_host_blocks=2)
    seq = make_seq(1, 40)
    admit(kv, seq)
    assert kv.swap_out([seq]) is None
    assert kv.reservations[1] == (0, 4) and seq.block_table == [0, 1, 2]


def test_swap_in_returns_none_and_changes_nothing_when_no_slab_fits():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=BS, max_model_len=64,
                                  num_host_blocks=4)
    seq = make_seq(1, 40)
    admit(kv, seq)
    kv.swap_out([seq])
    admit(kv, make_seq(2, 10))
    admit(kv, make_seq(3, 10))
    assert kv.swap_in([seq]) is None
    assert seq.host_table == [0, 1, 2] and kv.num_free_blocks == 0


def test_scheduler_rejects_a_request_whose_samples_need_more_slabs_than_the_pool():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=BS, max_model_len=64)
    sched = Scheduler(kv, max_model_len=64)
    req = Request(1, 0.0, 10, 5, n=3)              # 3 slabs of 4 blocks > 8
    sched.add_request(req)
    assert req.status.name == "REJECTED" and "KV blocks" in req.reason
