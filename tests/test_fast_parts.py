"""The pieces the simulator's speed rests on, each against the plain way it replaces.

- exact_partials: a sum that takes its constant terms as partials is the same float as the sum
  of every term (the decode-run cost model sums its steps that way);
- FreeQueue: the free blocks' order, through takes from the front, take-backs from the middle,
  frees and compactions, is that of an ordered dict used as an LRU list;
- unique block hashes: a prompt's and a sample's own blocks, made in one go, are hashed as
  block by block.
"""
import math
from collections import OrderedDict

from hypothesis import given, settings, strategies as st

from simkv.costmodel.step_cost import exact_partials
from simkv.engine.kv.block_pool import FreeQueue
from simkv.engine.kv.hashing import extend_block_hashes
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
    assert sum(constant) + 0.5 != 1.5 + 1e-3     # the naive sum drops the 1.0


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
