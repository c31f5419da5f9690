"""The fixed-shape steps' decode rows of a window hybrid are `step_inputs.group_tables`' layout at
every step of a served run, though GraphSteps keeps each sequence's table as an array between
steps: the rows follow the KV manager as it adds blocks, frees a window's leading blocks,
frees sequences and hands their ids to new ones.

Tiny Gemma 3 on the CPU (two 16-token window groups and a full one, block size 4), a
HybridKVCacheManager over a small pool; only the host arrays are compared (no forward)."""
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from simkv.engine.kv.groups import HybridKVCacheManager  # noqa: E402
from simkv.engine.plan import ScheduledSeq  # noqa: E402
from simkv.engine.request import Sequence  # noqa: E402
from simkv.gpu.executor import GpuExecutor  # noqa: E402
from simkv.gpu.profiler.grid import profile_kv_groups  # noqa: E402
from simkv.gpu.step_inputs import group_tables  # noqa: E402
from simkv.specs import load_model  # noqa: E402

BLOCK, NUM_BLOCKS, MAX_LEN, MAX_SEQS = 4, 400, 64, 8
TINY_GEMMA = str(Path(__file__).parent / "data" / "tiny-gemma3.json")


@pytest.fixture(scope="module")
def steps():
    spec = load_model(TINY_GEMMA)
    groups = profile_kv_groups(spec, BLOCK)
    ex = GpuExecutor(spec, NUM_BLOCKS, BLOCK, device="cpu", dtype=torch.float32,
                     attention="reference", max_num_seqs=MAX_SEQS, max_model_len=MAX_LEN,
                     max_num_batched_tokens=32, static_inputs=True, kv_groups=groups)
    return ex.steps


def written_rows(steps, items, kv):
    """(slots [groups, n], tables [groups, n, width]) as `_write_decode_rows` writes them."""
    n, n_t = len(items), steps.num_tables
    width = steps._decode_width(items)
    h = np.zeros((2 + n_t, n), dtype=np.int64)
    lens = np.zeros(n, dtype=np.int32)
    tables = np.full((n_t, n, width), -7, dtype=np.int32)
    steps._write_decode_rows(items, h, lens, tables, kv)
    assert list(h[1]) == [it.start for it in items]
    assert list(lens) == [it.start + 1 for it in items]
    return h[2:], tables


def check_rows(steps, items, kv):
    ex = steps.ex
    slots, tables = written_rows(steps, items, kv)
    for j, it in enumerate(items):
        p = it.start
        counts = kv.group_blocks_of(it.seq) if kv is not None else None
        want = group_tables(it.seq.block_table, counts, ex.group_is_full, ex.group_windows, p,
                            p + 1, BLOCK)
        for g, table in enumerate(want):
            assert list(tables[g, j, :len(table)]) == list(table), (g, j, p)
            assert slots[g, j] == table[p // BLOCK] * BLOCK + p % BLOCK, (g, j, p)


@pytest.mark.parametrize("manager", [True, False])
def test_decode_rows_follow_the_kv_managers_tables_step_by_step(steps, manager):
    # manager False: the same tables without the KV manager (every group the whole table)
    rng = np.random.default_rng(3)
    kv = HybridKVCacheManager(steps.ex.kv_groups, NUM_BLOCKS, BLOCK, enable_prefix_caching=False,
                              max_num_batched_tokens=32)
    finished, skipped_seen = 0, False

    def admit(seq_id):
        prompt = int(rng.integers(2, 30))
        seq = Sequence(seq_id=seq_id, request=None, sample=0, num_tokens=prompt + 1,
                       token_ids=rng.integers(0, 256, MAX_LEN).tolist())
        assert kv.allocate_slots(seq, prompt)
        seq.num_computed_tokens = prompt
        seq.num_output_tokens = int(rng.integers(1, MAX_LEN - prompt - 1))
        return seq

    running = [admit(i) for i in range(6)]
    for _ in range(120):
        for k, seq in enumerate(running):
            if seq.num_output_tokens <= 0:
                kv.free(seq)            # its id goes to the next sequence, its table to none
                running[k] = admit(seq.seq_id)
                finished += 1
        items = []
        for seq in running:
            assert kv.allocate_slots(seq, 1)
            items.append(ScheduledSeq(seq, seq.num_computed_tokens, 1, True))
        skipped_seen |= any(n for st in kv.state.values() for n in st.skipped)
        check_rows(steps, items, kv if manager else None)
        for seq in running:
            seq.num_computed_tokens += 1
            seq.num_tokens += 1
            seq.num_output_tokens -= 1
    assert finished >= 6 and skipped_seen
    assert len(steps._group_arrays) <= 4 * MAX_SEQS     # the freed sequences' arrays dropped


def test_decode_rows_follow_a_table_replaced_between_steps(steps):
    # the profiler's synthetic sequences: a new list for the same sequence is read anew
    seq = Sequence(seq_id=0, request=None, sample=0, num_tokens=40, token_ids=list(range(40)))
    items = [ScheduledSeq(seq, 39, 1, True)]
    seq.block_table = list(range(10))
    check_rows(steps, items, None)
    seq.block_table = list(range(100, 110))
    check_rows(steps, items, None)
