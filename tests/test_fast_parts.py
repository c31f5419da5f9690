"""The pieces the simulator's speed rests on, each against the plain way it replaces.

- exact_partials: a sum that takes its constant terms as partials is the same float as the sum
  of every term (the decode-run cost model sums its steps that way);
- FreeQueue: the free blocks' order, through takes from the front, take-backs from the middle,
  frees and compactions, is that of an ordered dict used as an LRU list;
- unique block hashes: a prompt's and a sample's own blocks, made in one go, are hashed as
  block by block, and as simulated_block_hash defines them;
- BlockPool: reference counts, the free queue's order, the hash index and the counters,
  through takes, touches, releases (with and without shared blocks), registrations and
  removals, are those of a plain model with one loop per block.
"""
import functools
import math
import operator
from collections import OrderedDict

from hypothesis import given, settings, strategies as st

from simkv.costmodel.step_cost import exact_partials
from simkv.engine.kv.block_pool import BlockPool, FreeQueue
from simkv.engine.kv.hashing import extend_block_hashes, simulated_block_hash, simulated_block_key
from simkv.engine.kv.paged import PagedKVCacheManager
from simkv.engine.request import Request, Sequence

floats = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12) \
    | st.floats(allow_nan=False, allow_infinity=False, min_value=-1e-3, max_value=1e-3)


@settings(max_examples=300, deadline=None)
@given(st.lists(floats, max_size=12), st.lists(floats, max_size=6))
def test_a_sum_over_the_partials_of_its_constants_is_the_same_float(constant, varying):
    assert math.fsum(exact_partials(constant) + varying) == math.fsum(constant + varying)


def test_partials_keep_what_a_plain_sum_loses():
    constant = [1e16, 1.0, -1e16, 1e-3]
    assert math.fsum(exact_partials(constant) + [0.5]) == 1.5 + 1e-3
    # added left to right, the 1.0 is lost (builtin sum compensates from Python 3.12 on)
    assert functools.reduce(operator.add, constant) + 0.5 != 1.5 + 1e-3


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "remove", "free"]),
                          st.integers(1, 40)), max_size=300))
def test_the_free_queue_keeps_the_order_of_an_lru_list(ops):
    n = 64
    queue, model = FreeQueue(n), OrderedDict.fromkeys(range(n))
    queue.COMPACT_AT = 8                       # compact often
    held = []                                  # blocks out of the queue, oldest first
    for op, k in ops:
        if op == "take" and model:
            count = 1 + k % len(model)
            expected = [model.popitem(False)[0] for _ in range(count)]
            assert queue.pop_front(count) == expected
            held.extend(expected)
        elif op == "remove" and model:
            block = list(model)[k % len(model)]
            del model[block]
            queue.remove(block)
            held.append(block)
        elif op == "free" and held:
            block = held.pop(k % len(held))
            model[block] = None
            queue.append(block)
        assert len(queue) == len(model)
        assert list(queue) == list(model)
        assert queue.front(k % (len(model) + 1)) == list(model)[:k % (len(model) + 1)]
        assert all((b in queue) == (b in model) for b in range(n))


def _hashes(prompt, output, block_size, prefix_ids=None, pbt=0, sample=0, steps=(5, 3, 100)):
    """A sequence's hashes grown in the given steps of full blocks, and block by block."""
    def seq():
        req = Request(request_id=7, arrival_s=0.0, prompt_tokens=prompt, output_tokens=output,
                      prefix_ids=prefix_ids, prefix_block_tokens=pbt)
        req.hash_root = 12345
        return Sequence(0, req, sample, prompt + output)
    total = (prompt + output) // block_size
    grown, one_by_one = seq(), seq()
    upto = 0
    for step in steps:
        upto = min(total, upto + step)
        extend_block_hashes(grown, upto, block_size)
    for i in range(1, total + 1):
        extend_block_hashes(one_by_one, i, block_size)
    return grown.block_hashes, one_by_one.block_hashes


def test_own_blocks_made_in_one_go_are_hashed_as_block_by_block():
    for args in [(100, 50, 16), (96, 64, 16, (1, 2, 3), 32), (40, 30, 16, (9,) * 10, 16, 2)]:
        grown, one_by_one = _hashes(*args)
        assert grown == one_by_one
        assert len(set(grown)) == len(grown)


def test_a_sample_s_own_blocks_differ_from_another_sample_s_and_the_prompt_s_are_shared():
    a, _ = _hashes(64, 64, 16, sample=0)
    b, _ = _hashes(64, 64, 16, sample=1)
    assert a[:4] == b[:4]                      # the prompt's four blocks
    assert not set(a[4:]) & set(b[4:])


def _defined_hashes(prompt, output, block_size, prefix_ids=None, pbt=0, sample=0):
    """A sequence's block hashes as simulated_block_key and simulated_block_hash define them."""
    req = Request(request_id=7, arrival_s=0.0, prompt_tokens=prompt, output_tokens=output,
                  prefix_ids=prefix_ids, prefix_block_tokens=pbt)
    out, parent = [], 12345
    for i in range((prompt + output) // block_size):
        parent = simulated_block_hash(12345, parent,
                                      simulated_block_key(req, i, sample, block_size))
        out.append(parent)
    return out


def test_block_hashes_grown_in_any_steps_are_those_the_keys_define():
    for args in [(100, 50, 16), (96, 64, 16, (1, 2, 3), 32), (40, 30, 16, (9,) * 10, 16, 2),
                 (16, 80, 16), (15, 80, 16), (17, 80, 16, None, 0, 1)]:
        for steps in [(5, 3, 100), (1,) * 20, (100,)]:
            grown, one_by_one = _hashes(*args, steps=steps)
            assert grown == one_by_one == _defined_hashes(*args)


class PlainPool:
    """BlockPool's state, kept the plain way: one loop step per block, an ordered dict as the
    LRU free list and a list of blocks (oldest first) per hash."""

    def __init__(self, n):
        self.ref = [0] * n
        self.free = OrderedDict.fromkeys(range(n))
        self.hash = {}                         # block -> hash
        self.index = {}                        # hash -> blocks, oldest first
        self.evictions = self.removals = 0

    def _unindex(self, block):
        h = self.hash.pop(block)
        self.index[h].remove(block)
        if not self.index[h]:
            del self.index[h]
        self.removals += 1

    def take(self, count):
        blocks = [self.free.popitem(False)[0] for _ in range(count)]
        for b in blocks:
            if b in self.hash:
                self._unindex(b)
                self.evictions += 1
            self.ref[b] = 1
        return blocks

    def touch(self, blocks):
        for b in blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1

    def release(self, blocks):
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def cache(self, block, h, duplicate):
        if block in self.hash or (h in self.index and not duplicate):
            return
        self.index.setdefault(h, []).append(block)
        self.hash[block] = h

    def uncache(self, block):
        if block in self.hash:
            self._unindex(block)

    def assert_same(self, pool):
        assert pool.ref_cnt == self.ref
        assert list(pool.free_queue) == list(self.free)
        assert pool.block_hash == [self.hash.get(b) for b in range(len(self.ref))]
        assert pool.cached == {h: blocks[0] for h, blocks in self.index.items()}
        assert pool.duplicates == {h: blocks[1:] for h, blocks in self.index.items()
                                   if len(blocks) > 1}
        assert pool.num_cached_free == sum(1 for b in self.free if b in self.hash)
        assert pool.num_shared_refs == sum(r - 1 for r in self.ref if r > 1)
        assert pool.num_shared_blocks == sum(1 for r in self.ref if r > 1)
        assert (pool.num_evictions, pool.num_removals) == (self.evictions, self.removals)
        pool.check()


@settings(max_examples=300, deadline=None)
@given(st.booleans(),
       st.lists(st.tuples(st.sampled_from(["take", "share", "release", "cache", "uncache"]),
                          st.integers(0, 1000), st.integers(0, 1000)), max_size=120))
def test_the_block_pool_keeps_the_state_of_a_plain_pool(duplicate, ops):
    n = 24
    pool, plain = BlockPool(n), PlainPool(n)
    pool.free_queue.COMPACT_AT = 8             # compact often
    tables = []                                # each a list of blocks holding one reference
    for op, a, b in ops:
        if op == "take" and plain.free:
            count = 1 + a % min(6, len(plain.free))
            blocks = pool.take(count)
            assert blocks == plain.take(count)
            tables.append(blocks)
        elif op == "share" and tables:
            # another table takes references on some of a table's blocks and on hashed free
            # ones (prefix hits), as a fork or an admission does
            source = tables[a % len(tables)]
            blocks = source[:1 + b % len(source)]
            blocks += [blk for blk in list(plain.free)[:b % 3] if blk in plain.hash]
            pool.touch(blocks)
            plain.touch(blocks)
            tables.append(list(blocks))
        elif op == "release" and tables:
            blocks = tables.pop(a % len(tables))[::-1]
            pool.release(iter(blocks))
            plain.release(blocks)
        elif op in ("cache", "uncache") and tables:
            table = tables[a % len(tables)]
            block = table[b % len(table)]
            if op == "cache":
                pool.cache(block, b % 5, duplicate)
                plain.cache(block, b % 5, duplicate)
            else:
                pool.uncache(block)
                plain.uncache(block)
        plain.assert_same(pool)


def _decoding(prompts, block_size):
    """A paged manager whose sequences hold their prompts and decode from the next token."""
    kv = PagedKVCacheManager(512, block_size)
    seqs = []
    for rid, prompt in enumerate(prompts):
        req = Request(rid, 0.0, prompt, 100)
        req.hash_root = 1
        seq = Sequence(rid, req, 0, prompt)
        assert kv.allocate_slots(seq, prompt)
        seq.num_computed_tokens = prompt
        seqs.append(seq)
    return kv, seqs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=5), st.sampled_from([1, 2, 4, 16]),
       st.integers(2, 20))
def test_a_decode_run_s_blocks_are_those_its_steps_one_by_one_take(prompts, block_size, steps):
    stepped, seqs = _decoding(prompts, block_size)
    run, run_seqs = _decoding(prompts, block_size)
    for _ in range(steps):                     # allocate_slots(seq, 1), step after step
        for seq in seqs:
            assert stepped.allocate_slots(seq, 1)
            seq.num_computed_tokens += 1
            seq.num_tokens += 1
    for seq in run_seqs:                       # step 1 as the scheduler schedules it
        assert run.allocate_slots(seq, 1)
    run.append_decode_tokens(run_seqs, prompts, steps, 2)
    assert [s.block_table for s in run_seqs] == [s.block_table for s in seqs]
    assert [s.num_cached_blocks for s in run_seqs] == [s.num_cached_blocks for s in seqs]
    assert run.pool.block_hash == stepped.pool.block_hash
    assert list(run.pool.free_queue) == list(stepped.pool.free_queue)
