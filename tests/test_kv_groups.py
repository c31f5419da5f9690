"""The KV manager of KV cache groups (simkv.engine.kv.groups): window blocks freed as they leave
the window, vLLM's prefix-hit rule across groups, one state block per linear-attention
sequence; a property test of the window bound under random schedules."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import simkv
from simkv.engine.kv.groups import NULL, HybridKVCacheManager
from simkv.engine.request import Request, Sequence
from simkv.sim.engine import Simulation

DATA = Path(__file__).resolve().parent / "data"
BS = 4


def groups(window=8, linear=False):
    """A window group and a full group (or a linear state and a full group), 2 layers each."""
    first = {"attention_type": "linear", "window": None, "block_size": 4096, "num_layers": 2} \
        if linear else {"attention_type": "sliding", "window": window, "block_size": BS,
                        "num_layers": 2}
    return [first, {"attention_type": "full", "window": None, "block_size": BS, "num_layers": 2}]


def manager(num_blocks=64, **kw):
    return HybridKVCacheManager(groups(**{k: kw.pop(k) for k in ("window", "linear") if k in kw}),
                                num_blocks, BS, **kw)


def sequence(seq_id: int, prompt: int, request_id=None) -> Sequence:
    """A sequence whose prompt is shared with every other made with the same request id."""
    req = Request(request_id if request_id is not None else seq_id, 0.0, prompt, 8,
                  prefix_ids=tuple(range(prompt)), prefix_block_tokens=1)
    return Sequence(seq_id, req, 0, prompt)


def step(kv, seq, tokens):
    """Allocate `tokens` more and compute them, as a scheduled step does."""
    assert kv.allocate_slots(seq, tokens)
    seq.num_computed_tokens += tokens
    kv.check_integrity()


# --- windows ----------------------------------------------------------------------------------

def test_window_blocks_are_freed_before_the_next_allocation():
    kv = manager()
    seq = sequence(0, 40)
    step(kv, seq, 40)                       # 10 blocks in each group
    assert kv.group_blocks_of(seq) == [10, 10]
    assert kv.allocate_slots(seq, 1)        # 40 computed: tokens 0..32 are before the window
    sliding = kv.state[0].tables[0]
    assert sliding[:8] == [NULL] * 8        # (40 - 8 + 1) // 4 = 8 blocks freed
    assert kv.group_blocks_of(seq) == [3, 11]
    kv.check_integrity()


def test_freed_window_blocks_stay_hittable_in_the_free_queue():
    kv = manager()
    seq = sequence(0, 40)
    step(kv, seq, 40)
    step(kv, seq, 1)
    assert kv.num_cached_free_blocks == 8   # the skipped blocks, hashed, free
    kv.free(seq)
    assert kv.num_used_blocks == 0


@settings(max_examples=60, deadline=None)
@given(window=st.integers(2, 40), chunks=st.lists(st.integers(1, 37), min_size=1, max_size=25))
def test_a_window_group_holds_at_most_its_bound_after_each_allocation(window, chunks):
    # ceil((window - 1 + tokens scheduled) / block_size) + 1 blocks, and exactly the blocks from
    # the first one the window reaches to the last one written
    kv = manager(num_blocks=512, window=window)
    seq = sequence(0, sum(chunks))
    for n in chunks:
        c = seq.num_computed_tokens
        assert kv.allocate_slots(seq, n)
        held = kv.group_blocks_of(seq)[0]
        assert held <= -(-(window - 1 + n) // BS) + 1
        assert held == -(-(c + n) // BS) - max(0, c - window + 1) // BS
        kv.check_integrity()
        seq.num_computed_tokens += n
    kv.free(seq)
    assert kv.num_used_blocks == 0 and kv.group_used == [0, 0]


def test_the_integrity_check_catches_a_window_table_over_its_bound():
    kv = manager()
    seq = sequence(0, 40)
    step(kv, seq, 40)
    kv.state[0].last_new = 1                # as if only one token had been scheduled
    with pytest.raises(AssertionError, match="more than ceil"):
        kv.check_integrity()


# --- prefix hits ------------------------------------------------------------------------------

def hit_after(uncache_sliding=(), uncache_full=(), prompt=41):
    """A second request with the first one's prompt, after dropping the first one's hashes of
    the given blocks (as if evicted): (hit tokens, its window group's blocks)."""
    kv = manager()
    first = sequence(0, prompt, request_id=7)
    assert kv.allocate_slots(first, prompt)    # blocks registered as the step is planned
    first.num_computed_tokens = prompt
    tables = kv.state[0].tables
    for i in uncache_sliding:
        kv.pool.uncache(tables[0][i])
    for i in uncache_full:
        kv.pool.uncache(tables[1][i])
    hit, tokens = kv.prefix_lookup(sequence(1, prompt, request_id=7))
    return tokens, (hit.blocks[0] if hit else None), tables


def test_a_hit_in_every_group_takes_every_full_block_but_the_last_token():
    tokens, window_blocks, tables = hit_after()
    assert tokens == 40                     # (41 - 1) // 4 blocks
    # the window group takes what the window needs: the last ceil((8 - 1) / 4) = 2 blocks
    assert window_blocks == [NULL] * 8 + tables[0][8:10]


def test_a_window_hit_ends_at_the_last_run_of_window_blocks():
    # window 8, block 4: ceil(7 / 4) = 2 contiguous blocks; block 9 is gone, 7 and 8 remain
    tokens, window_blocks, tables = hit_after(uncache_sliding=[9])
    assert tokens == 9 * BS
    assert window_blocks == [NULL] * 7 + tables[0][7:9]


def test_without_a_run_of_window_blocks_only_the_leading_run_hits():
    tokens, window_blocks, tables = hit_after(uncache_sliding=[1, 3, 5, 7, 9])
    assert tokens == 1 * BS and window_blocks == tables[0][:1]


def test_the_full_group_bounds_the_window_groups_search():
    tokens, window_blocks, _ = hit_after(uncache_full=[5])
    assert tokens == 5 * BS                 # blocks 0..4 in both groups


def test_a_hit_skips_the_blocks_before_its_window_and_takes_fresh_ones():
    kv = manager()
    first = sequence(0, 41, request_id=7)
    step(kv, first, 41)
    second = sequence(1, 41, request_id=7)
    hit, tokens = kv.prefix_lookup(second)
    used = kv.num_used_blocks
    assert kv.allocate_slots(second, 41 - tokens, hit, admission=True)
    # 40 hit tokens: (40 - 8 + 1) // 4 = 8 window blocks skipped (null), 2 shared, 1 new
    assert kv.state[1].tables[0][:8] == [NULL] * 8
    assert kv.state[1].tables[0][8:10] == kv.state[0].tables[0][8:10]
    assert kv.num_used_blocks == used + 1 + 1   # a new block in each group for token 41
    second.num_computed_tokens = 41
    kv.check_integrity()


# --- linear attention -------------------------------------------------------------------------

def test_a_linear_attention_sequence_holds_one_state_block():
    kv = manager(linear=True, enable_prefix_caching=True)
    assert not kv.enable_prefix_caching     # off with linear-attention groups, as in vLLM
    seq = sequence(0, 30)
    for n in (12, 12, 6, 1, 1):
        step(kv, seq, n)
        assert kv.group_blocks_of(seq)[0] == 1
    assert kv.group_blocks_of(seq)[1] == -(-32 // BS)
    assert kv.blocks_needed(100) == 1 + 25


def test_allocation_is_all_or_nothing_across_groups():
    kv = manager(num_blocks=12)
    seq = sequence(0, 40)
    assert not kv.allocate_slots(seq, 40)   # 10 + 10 blocks do not fit in 12
    assert kv.num_used_blocks == 0 and kv.state == {}


# --- through the simulator --------------------------------------------------------------------

@pytest.mark.parametrize("model", ["tiny-window", "tiny-linear"])
def test_hybrid_models_simulate_clean_and_report_use_per_group(model):
    raw = {"name": "groups", "model": str(DATA / f"{model}.json"), "cost_model": "roofline",
           "cache": {"block_size": 16, "num_gpu_blocks_override": 120},
           "scheduler": {"max_model_len": 512, "max_num_batched_tokens": 256,
                         "max_num_seqs": 16},
           "workload": {"synthetic": {"num_requests": 40, "arrival": {"rate": 400},
                                      "prompt_tokens": {"dist": "uniform", "min": 1, "max": 400},
                                      "output_tokens": {"dist": "uniform", "min": 1, "max": 60},
                                      "shared_prefix": {"num_groups": 1, "prefix_tokens": 64,
                                                        "fraction": 1.0, "block_tokens": 16}}}}
    sim = Simulation(simkv.load_scenario(raw), check_integrity=True)
    s = sim.run().summary
    assert s["leaked_blocks"] == 0 and s["requests_completed"] == 40
    kinds = [g["attention_type"] for g in s["kv_groups"]]
    assert kinds == (["sliding", "full"] if model == "tiny-window" else ["linear", "full"])
    peaks = [g["blocks_used_peak"] for g in s["kv_groups"]]
    assert 0 < peaks[0] < peaks[1]          # the window (or the state) holds fewer blocks
    if model == "tiny-window":
        assert s["prefix_cache_hit_ratio"] > 0
