"""The fixed-shape (CUDA-graph) step layout gives the eager step's answer for any composition.

Property test on CPU: the bundled `tiny` model in float64 with the torch reference attention, two
executors with the same weights and the same cache contents, one eager and one running every step
through `GraphSteps`' static buffers (decode rows first, then the chunks, then padding). For random
mixes of decodes and prefill chunks (with cached prefixes, one-token chunks, a step that fills its
token bucket exactly) the sampled tokens and the K/V the step writes must be the same.

A window hybrid's steps (tiny Gemma 3 with the engine's KV cache groups, float32) go through the
same comparison with a KV manager that keeps a table per group: the sequences' earlier tokens
are allocated chunk by chunk as serving does, so the window groups' tables have freed leading
entries, and the fixed-shape step must give the eager step's tokens, logits and K/V.
"""
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
from hypothesis import HealthCheck, example, given, settings, strategies as st  # noqa: E402

from simkv.engine.kv.groups import HybridKVCacheManager  # noqa: E402
from simkv.engine.plan import ScheduledSeq, StepPlan  # noqa: E402
from simkv.engine.request import Sequence  # noqa: E402
from simkv.specs import load_model  # noqa: E402
from simkv.gpu.executor import GpuExecutor  # noqa: E402

BLOCK, NUM_BLOCKS, MAX_LEN, MAX_TOKENS, MAX_SEQS = 4, 160, 64, 32, 8
# Gemma 3's layers, two of three with a 16-token window (the profiler graphs its steps so)
TINY_GEMMA = str(Path(__file__).parent / "data" / "tiny-gemma3.json")
GROUP_BLOCKS = 512         # 8 sequences of up to 64 tokens in three groups' tables


def make_executors(dtype, attention, model="tiny"):
    spec = load_model(model)
    kw = dict(device="cpu", dtype=dtype, attention=attention, max_num_seqs=MAX_SEQS,
              max_model_len=MAX_LEN, max_num_batched_tokens=MAX_TOKENS)
    return (GpuExecutor(spec, NUM_BLOCKS, BLOCK, **kw),
            GpuExecutor(spec, NUM_BLOCKS, BLOCK, static_inputs=True, **kw))


@pytest.fixture(scope="module")
def executors():
    return make_executors(torch.float64, "reference")


@pytest.fixture(scope="module")
def triton_executors():
    from simkv.gpu.kernels import INTERPRET
    if not INTERPRET:       # these executors are CPU ones, on a GPU machine too
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    return make_executors(torch.float32, "triton")


@pytest.fixture(scope="module")
def gemma_triton_executors():
    from simkv.gpu.kernels import INTERPRET
    if not INTERPRET:       # these executors are CPU ones, on a GPU machine too
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    return make_executors(torch.float32, "triton", TINY_GEMMA)


@st.composite
def compositions(draw):
    """(start, num_tokens, is_decode) items: up to 8 sequences, at most 32 tokens in all."""
    items, tokens = [], 0
    for _ in range(draw(st.integers(1, MAX_SEQS))):
        if draw(st.booleans()):
            context = draw(st.integers(1, MAX_LEN - 1))
            item, need = (context - 1, 1, True), 1
        else:
            n = draw(st.integers(1, 16))
            start = draw(st.integers(0, MAX_LEN - 1 - n))
            item, need = (start, n, False), n
        if tokens + need > MAX_TOKENS:
            break
        items.append(item)
        tokens += need
    return items


def plan_of(items, seed):
    rng = np.random.default_rng(seed)
    perm = rng.permutation(NUM_BLOCKS)
    plan, used = StepPlan(step=0, now_s=0.0), 0
    for i, (start, n, is_decode) in enumerate(items):
        blocks = -(-(start + n) // BLOCK)
        seq = Sequence(seq_id=i, request=None, sample=0, num_tokens=start + n,
                       num_computed_tokens=start, block_table=perm[used:used + blocks].tolist(),
                       token_ids=rng.integers(0, 256, start + n).tolist())
        used += blocks
        plan.scheduled.append(ScheduledSeq(seq, start, n, is_decode))
    return plan


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=compositions(), seed=st.integers(0, 2**16))
def test_static_steps_give_the_eager_tokens_and_kv(executors, items, seed):
    check_same_step(*executors, items, seed, atol=1e-12)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=compositions(), seed=st.integers(0, 2**16))
def test_the_kernels_in_the_fixed_shape_layout_give_the_eager_answer(triton_executors, items,
                                                                     seed):
    # the Triton kernels themselves: decode rows of sequence length 0 and chunks past row 0
    check_same_step(*triton_executors, items, seed, atol=1e-5)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=compositions(), seed=st.integers(0, 2**16))
def test_gemma_3s_windowed_layers_in_the_fixed_shape_layout_give_the_eager_answer(
        gemma_triton_executors, items, seed):
    check_same_step(*gemma_triton_executors, items, seed, atol=1e-5)


def check_same_step(eager, static, items, seed, atol):
    with torch.inference_mode():
        eager.caches.copy_(torch.randn(eager.caches.shape, dtype=eager.caches.dtype,
                                       generator=torch.Generator().manual_seed(seed)))
        static.caches.copy_(eager.caches)
    steps_before = static.num_graph_steps + static.num_mixed_graph_steps
    want = eager.execute(plan_of(items, seed))
    got = static.execute(plan_of(items, seed))
    assert static.num_graph_steps + static.num_mixed_graph_steps == steps_before + 1
    assert got == want
    assert torch.allclose(static.caches, eager.caches, rtol=0, atol=atol)


def test_a_step_that_fills_its_bucket_exactly_runs_as_a_graph(executors):
    eager, static = executors
    items = [(9, 1, True)] * 4 + [(0, 12, False)]        # 16 tokens: the first bucket, full
    assert static.steps.mixed_bucket(1, 4, 16) == 16
    mixed = static.num_mixed_graph_steps
    assert static.execute(plan_of(items, 1)) == eager.execute(plan_of(items, 1))
    assert static.num_mixed_graph_steps == mixed + 1


# -- KV cache groups (a window hybrid) -------------------------------------------------------


def make_group_executors(attention):
    from simkv.gpu.profiler.grid import profile_kv_groups
    spec = load_model(TINY_GEMMA)
    groups = profile_kv_groups(spec, BLOCK)        # the engine's: sliding, sliding, full
    kw = dict(device="cpu", dtype=torch.float32, attention=attention, max_num_seqs=MAX_SEQS,
              max_model_len=MAX_LEN, max_num_batched_tokens=MAX_TOKENS, kv_groups=groups)
    return (GpuExecutor(spec, GROUP_BLOCKS, BLOCK, **kw),
            GpuExecutor(spec, GROUP_BLOCKS, BLOCK, static_inputs=True, **kw))


@pytest.fixture(scope="module")
def group_executors():
    return make_group_executors("reference")


@pytest.fixture(scope="module")
def group_triton_executors():
    from simkv.gpu.kernels import INTERPRET
    if not INTERPRET:       # these executors are CPU ones, on a GPU machine too
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported")
    return make_group_executors("triton")


def group_plan_of(items, seed, groups):
    """The step of `items` with a KV manager of `groups`: each sequence's tokens before its
    chunk allocated in chunks of 1-8 tokens, the sequences taking turns (as serving interleaves
    them, so their blocks interleave and the windows free their leading blocks), then the
    step's tokens. Returns (plan, KV manager)."""
    rng = np.random.default_rng(seed)
    kv = HybridKVCacheManager(groups, GROUP_BLOCKS, BLOCK, enable_prefix_caching=False,
                              max_num_batched_tokens=MAX_TOKENS)
    seqs = [Sequence(seq_id=i, request=None, sample=0, num_tokens=start + n,
                     token_ids=rng.integers(0, 256, start + n).tolist())
            for i, (start, n, _) in enumerate(items)]
    behind = True
    while behind:
        behind = False
        for seq, (start, _, _) in zip(seqs, items):
            if seq.num_computed_tokens < start:
                k = min(start - seq.num_computed_tokens, int(rng.integers(1, 9)))
                assert kv.allocate_slots(seq, k)
                seq.num_computed_tokens += k
                behind = True
    plan = StepPlan(step=0, now_s=0.0)
    for seq, (start, n, is_decode) in zip(seqs, items):
        assert kv.allocate_slots(seq, n)
        plan.scheduled.append(ScheduledSeq(seq, start, n, is_decode))
    kv.check_integrity()
    return plan, kv


def sampled_logits(executor, plan, kv) -> tuple:
    """(tokens, {seq_id: logits of its sampled row}) of one step."""
    seen = []
    forward = executor.model.forward

    def recording(*args, **kwargs):
        seen.append(forward(*args, **kwargs))
        return seen[-1]
    executor.model.forward = recording
    try:
        tokens = executor.execute(plan, kv)
    finally:
        del executor.model.forward
    prefill = [it for it in plan.scheduled if it.num_tokens > 1]
    single = [it for it in plan.scheduled if it.num_tokens == 1]
    order = single + prefill if executor.static_inputs else prefill + single
    return tokens, {it.seq.seq_id: seen[-1][row] for row, it in enumerate(order)}


def check_same_group_step(eager, static, items, seed, atol, manager=True):
    """`manager` False: no KV manager (the profiler's steps), every group the whole table."""
    if manager:
        plan, kv = group_plan_of(items, seed, eager.kv_groups)
        if max(start for start, _, _ in items) >= 19:     # the 16-token window freed a block
            assert any(n for st in kv.state.values() for n in st.skipped)
    else:
        plan, kv = plan_of(items, seed), None
    with torch.inference_mode():
        eager.caches.copy_(torch.randn(eager.caches.shape, dtype=eager.caches.dtype,
                                       generator=torch.Generator().manual_seed(seed)))
        static.caches.copy_(eager.caches)
    steps_before = static.num_graph_steps + static.num_mixed_graph_steps
    want, want_logits = sampled_logits(eager, plan, kv)
    got, got_logits = sampled_logits(static, plan, kv)
    assert static.num_graph_steps + static.num_mixed_graph_steps == steps_before + 1
    assert got == want
    for seq_id, logits in want_logits.items():
        torch.testing.assert_close(got_logits[seq_id], logits, rtol=1e-5, atol=atol)
    assert torch.allclose(static.caches, eager.caches, rtol=0, atol=atol)


# decode-only: 3 rows in the bucket of 4, 5 in the bucket of 8; mixed: 13 tokens in the bucket
# of 16, 21 in the bucket of 32; every one with a sequence past its 16-token window
GROUP_EXAMPLES = [[(40, 1, True), (17, 1, True), (5, 1, True)],
                  [(62, 1, True), (15, 1, True), (33, 1, True), (0, 1, True), (48, 1, True)],
                  [(30, 1, True), (20, 12, False)],
                  [(50, 1, True), (9, 1, True), (36, 10, False), (18, 9, False)]]


def with_examples(*which):
    def add(test):
        for i in which:
            test = example(items=GROUP_EXAMPLES[i], seed=7)(test)
        return test
    return add


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=compositions(), seed=st.integers(0, 2**16))
@with_examples(0, 1, 2, 3)
def test_kv_group_steps_in_the_fixed_shape_layout_give_the_eager_tokens_logits_and_kv(
        group_executors, items, seed):
    check_same_group_step(*group_executors, items, seed, atol=1e-5)


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=compositions(), seed=st.integers(0, 2**16))
@with_examples(0, 3)
def test_kv_group_steps_through_the_kernels_in_the_fixed_shape_layout_give_the_eager_answer(
        group_triton_executors, items, seed):
    check_same_group_step(*group_triton_executors, items, seed, atol=1e-5)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=compositions(), seed=st.integers(0, 2**16))
@with_examples(0, 3)
def test_kv_group_steps_without_a_kv_manager_give_the_eager_answer(group_executors, items, seed):
    # the profiler's synthetic sequences: every group uses the whole table
    check_same_group_step(*group_executors, items, seed, atol=1e-5, manager=False)
