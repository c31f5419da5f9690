"""The paged-cache kernels match the torch reference (simkv.gpu.reference).

Without a GPU they run under Triton's CPU interpreter (TRITON_INTERPRET=1, set before triton is
first imported), so shapes stay small. Every check draws fresh random data, poisons outputs
with NaN first, and compares by relative Frobenius error against the fp32 reference.
"""

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from simkv.gpu import reference  # noqa: E402
from simkv.gpu.kernels import (  # noqa: E402
    INTERPRET,
    PrefillConfig,
    copy_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
)
from simkv.gpu.swap import HostSwapSpace, swap_in, swap_out  # noqa: E402

if INTERPRET:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
SMALL_PREFILL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output has NaN (unwritten or bad softmax)"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_paged(gen, lens, block_size, num_kv_heads, head_dim, dtype, spare_blocks=3):
    """Random K/V caches holding len(lens) sequences in shuffled blocks, and their block tables."""
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * max_blocks + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    order = torch.randperm(num_blocks, generator=gen)[: len(lens) * max_blocks]
    block_tables = order.view(len(lens), max_blocks).to(torch.int32).to(DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, block_tables, seq_lens


def check_decode(seed, lens, block_size, num_kv_heads, group, head_dim, dtype, num_splits=None, scale=None):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out, num_splits=num_splits)
    ref = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens, scale)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_lengths_around_the_block_size(block_size, dtype):
    lens = [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3]
    check_decode(1, lens, block_size, num_kv_heads=2, group=4, head_dim=64, dtype=dtype)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_gqa_ratios(group):
    check_decode(2, [37, 70], 16, num_kv_heads=2, group=group, head_dim=64, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_head_dim_128(dtype):
    check_decode(3, [3, 130], 32, num_kv_heads=1, group=4, head_dim=128, dtype=dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_decode_split_k_merge_gives_the_same_answer(num_splits):
    # 7 splits over a 40-token sequence leaves some splits empty; they must weigh nothing.
    check_decode(4, [40, 1, 300], 16, num_kv_heads=1, group=4, head_dim=64, dtype=torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("block_size", [64, 256])
def test_decode_large_blocks(block_size):
    check_decode(5, [1, block_size + 1, 2 * block_size], block_size, 1, 2, 64, torch.float32)


def test_decode_custom_scale():
    check_decode(6, [20, 33], 16, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32, scale=0.3)


def test_decode_one_token_returns_its_value_exactly():
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, [1, 1], 16, 2, 64, torch.float32)
    q = torch.randn(2, 8, 64, generator=gen).to(DEVICE) * 100  # large scores: no overflow either
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    first_value = v_cache[block_tables[:, 0].long(), 0]  # [2, kv_heads, dim]
    torch.testing.assert_close(out, first_value.repeat_interleave(4, dim=1))


def check_prefill(seed, q_lens, cached, block_size, num_kv_heads, group, head_dim, dtype):
    gen = torch.Generator().manual_seed(seed)
    lens = [q + c for q, c in zip(q_lens, cached)]
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, lens, block_size, num_kv_heads, head_dim, dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    config = SMALL_PREFILL if INTERPRET else None
    paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out=out, config=config)
    ref = reference.paged_prefill_attention(
        q.float(), k_cache.float(), v_cache.float(), block_tables, query_start_loc, seq_lens
    )
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_without_cached_prefix(dtype):
    check_prefill(10, [1, 15, 16, 17, 40], [0] * 5, 16, num_kv_heads=2, group=4, head_dim=64, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_over_a_cached_prefix(dtype):
    # chunked prefill / prefix-cache hits: the chunk attends to all cached tokens and causally to itself
    check_prefill(11, [5, 33, 1, 20], [16, 7, 50, 0], 8, num_kv_heads=2, group=4, head_dim=64, dtype=dtype)


@pytest.mark.parametrize("group", [1, 8])
def test_prefill_gqa_ratios_and_head_dim_128(group):
    check_prefill(12, [18, 3], [5, 30], 16, num_kv_heads=1, group=group, head_dim=128, dtype=torch.float32)


def test_prefill_skips_sequences_with_no_new_tokens():
    check_prefill(13, [0, 9, 0], [4, 12, 3], 16, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32)


def test_reshape_and_cache_writes_slots_and_skips_negative_ones():
    gen = torch.Generator().manual_seed(20)
    num_blocks, block_size, heads, dim = 6, 8, 3, 64  # 3 heads: not a power of two
    k_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(DEVICE)
    key = torch.randn(5, heads, dim, generator=gen).to(DEVICE)
    value = torch.randn(5, heads, dim, generator=gen).to(DEVICE)
    slots = torch.tensor([0, 13, -1, 47, 9], dtype=torch.int64, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reference.reshape_and_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache[13 // 8, 13 % 8], key[1])


def test_reshape_and_cache_casts_to_the_cache_dtype():
    gen = torch.Generator().manual_seed(21)
    k_cache = torch.zeros(2, 16, 2, 64, dtype=torch.float16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(2, 2, 64, generator=gen).to(DEVICE)
    reshape_and_cache(key, -key, k_cache, v_cache, torch.tensor([17, 3], device=DEVICE))
    assert torch.equal(k_cache[1, 1], key[0].half()) and torch.equal(v_cache[0, 3], -key[1].half())


def test_copy_blocks_copies_whole_blocks_and_nothing_else():
    gen = torch.Generator().manual_seed(30)
    k_cache = torch.randn(8, 16, 2, 64, generator=gen).to(DEVICE)
    v_cache = torch.randn(8, 16, 2, 64, generator=gen).to(DEVICE)
    mapping = torch.tensor([[1, 5], [2, 7], [1, 0]], dtype=torch.int64, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    copy_blocks(k_cache, v_cache, mapping)
    reference.copy_blocks(k_ref, v_ref, mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache[5], k_cache[1]) and torch.equal(v_cache[7], v_cache[2])


@pytest.mark.parametrize("chunk_blocks", [None, 1, 3])
@pytest.mark.parametrize("stacked", [True, False])
def test_swap_out_then_in_restores_blocks_in_any_host_order(stacked, chunk_blocks, monkeypatch):
    # chunk_blocks: a staging budget of that many blocks, so that a swap moves in several chunks
    from simkv.gpu import swap
    if chunk_blocks is not None:
        monkeypatch.setattr(swap, "STAGING_BYTES", chunk_blocks * 3 * 2 * 4 * 2 * 16 * 4)
    gen = torch.Generator().manual_seed(40)
    layers, num_blocks = 3, 10
    stack = torch.randn(layers, 2, num_blocks, 4, 2, 16, generator=gen).to(DEVICE)
    caches = stack if stacked else [(stack[i, 0], stack[i, 1]) for i in range(layers)]
    space = HostSwapSpace.allocate(6, caches)
    mapping = [(7, 4), (2, 0), (3, 1), (9, 5)]  # host runs 0-1 and 4-5
    original = stack.clone()
    swap_out(caches, space, mapping)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    for dev, host in mapping:
        assert torch.equal(space.blocks[host].to(DEVICE), original[:, :, dev])
    stack[:, :, [7, 2, 3, 9]] = 0.0
    swap_in(caches, space, [(8, 4), (2, 0), (3, 1), (9, 5)])  # device block 7 comes back as 8
    assert torch.equal(stack[:, :, 8], original[:, :, 7])
    assert torch.equal(stack[:, :, [2, 3, 9]], original[:, :, [2, 3, 9]])


def test_a_swap_out_releases_each_chunk_before_gathering_the_next(monkeypatch):
    # sizing reserves the staging of one chunk's gather (two chunk-sized tensors); an earlier
    # chunk still referenced while the next is gathered would hold a third
    import weakref
    from simkv.gpu import swap
    monkeypatch.setattr(swap, "STAGING_BYTES", 2 * 3 * 2 * 4 * 2 * 16 * 4)   # 2 blocks a chunk
    gathered, alive_at_gather = [], []
    real_gather = swap._gather

    def tracking_gather(caches, ids):
        alive_at_gather.append(sum(ref() is not None for ref in gathered))
        out = real_gather(caches, ids)
        gathered.append(weakref.ref(out))
        return out

    monkeypatch.setattr(swap, "_gather", tracking_gather)
    stack = torch.randn(3, 2, 10, 4, 2, 16).to(DEVICE)
    space = HostSwapSpace.allocate(8, stack)
    swap_out(stack, space, [(d, h) for h, d in enumerate(range(7))])
    assert len(gathered) == 4 and alive_at_gather == [0, 0, 0, 0]


def test_decode_writes_into_caller_buffers():
    # what CUDA-graph capture needs: preallocated out and workspace, no allocation inside
    from simkv.gpu.kernels import decode_workspace_numel

    gen = torch.Generator().manual_seed(50)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, [9, 50], 16, 1, 64, torch.float32)
    q = torch.randn(2, 4, 64, generator=gen).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    workspace = torch.full((decode_workspace_numel(2, 4, 64, 3),), float("nan"), device=DEVICE)
    result = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out=out, workspace=workspace, num_splits=3)
    assert result is out
    ref = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    assert rel_err(out, ref) < 1e-5


def test_reference_runs_in_float64():
    gen = torch.Generator().manual_seed(51)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, [5, 12], 4, 1, 16, torch.float64)
    q = torch.randn(2, 2, 16, generator=gen, dtype=torch.float64).to(DEVICE)
    out = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    assert out.dtype == torch.float64
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    # decode is prefill with one new token per sequence
    prefill = reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, qsl, seq_lens)
    torch.testing.assert_close(prefill, out, rtol=1e-12, atol=1e-12)


def test_single_sequence_decode_and_prefill():
    check_decode(60, [45], 16, num_kv_heads=1, group=4, head_dim=64, dtype=torch.float32, num_splits=3)
    check_prefill(61, [7], [20], 16, num_kv_heads=1, group=4, head_dim=64, dtype=torch.float32)


# -- fixed-shape (CUDA-graph) steps: padding rows ----------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_leaves_padding_rows_untouched(num_splits):
    # seq_len 0 marks a padding row: nothing is read for it and its output row keeps its value
    gen = torch.Generator().manual_seed(21)
    k_cache, v_cache, block_tables, _ = make_paged(gen, [40, 40, 40, 40], 16, 2, 64, torch.float32)
    seq_lens = torch.tensor([40, 0, 17, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(4, 8, 64, generator=gen).to(DEVICE)
    out = torch.full_like(q, 7.0)
    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out=out, num_splits=num_splits)
    ref = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                           out=torch.full_like(q, 7.0))
    assert (out[[1, 3]] == 7.0).all()
    assert rel_err(out, ref) < TOL[torch.float32]


def test_prefill_with_rows_before_and_after_its_sequences():
    # a fixed-shape step: decode rows [0, 3) first, two chunks at rows [3, 12), padding [12, 20),
    # and two padding sequences with no new tokens; only rows [3, 12) are written
    gen = torch.Generator().manual_seed(22)
    k_cache, v_cache, block_tables, _ = make_paged(gen, [20, 30, 1, 1], 8, 2, 64, torch.float32)
    seq_lens = torch.tensor([20, 30, 0, 0], dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.tensor([3, 7, 12, 12, 12], dtype=torch.int32, device=DEVICE)
    q = torch.randn(20, 8, 64, generator=gen).to(DEVICE)
    out = torch.full_like(q, 7.0)
    config = SMALL_PREFILL if INTERPRET else None
    paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out=out,
                            config=config)
    ref = reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                            seq_lens, out=torch.full_like(q, 7.0))
    assert (out[:3] == 7.0).all() and (out[12:] == 7.0).all()
    assert not (ref[3:12] == 7.0).all()
    assert rel_err(out, ref) < TOL[torch.float32]


# -- split merge inside the decode kernel (the last split program of a (sequence, KV head)) ---


def _decode_both_merges(seed, lens, block_size, num_kv_heads, group, head_dim, dtype, num_splits, counters=None,
                        seq_lens=None):
    """(fused-merge output, second-kernel-merge output, reference); outputs start at NaN."""
    from simkv.gpu.kernels import DecodeConfig, decode_config

    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables, lens_t = make_paged(gen, lens, block_size, num_kv_heads, head_dim, dtype)
    seq_lens = lens_t if seq_lens is None else seq_lens
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    base = decode_config(block_size, head_dim, dtype)
    outs = []
    for fused in (True, False):
        cfg = DecodeConfig(base.tile, base.num_warps, base.num_stages, fused_merge=fused)
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out=out, num_splits=num_splits,
                               config=cfg, counters=counters if fused else None)
        outs.append(out)
    ref = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens)
    return outs[0], outs[1], ref


@pytest.mark.parametrize("num_splits", [1, 2, 3, 40])
def test_decode_fused_merge_matches_the_reference_and_the_merge_kernel(num_splits):
    # lengths 1, B-1, B, B+1 and a long one; 40 splits leave most splits of the short ones empty
    # and take several merge chunks
    block = 16
    fused, apart, ref = _decode_both_merges(70 + num_splits, [1, block - 1, block, block + 1, 300], block,
                                            num_kv_heads=2, group=4, head_dim=64, dtype=torch.float32,
                                            num_splits=num_splits)
    assert rel_err(fused, ref) < TOL[torch.float32]
    assert rel_err(apart, ref) < TOL[torch.float32]
    torch.testing.assert_close(fused, apart, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_fused_merge_gqa_groups(group):
    # group 3 is not a power of two: the merge pads the group and must not write the pad rows
    fused, _, ref = _decode_both_merges(80 + group, [37, 70], 16, num_kv_heads=2, group=group, head_dim=64,
                                        dtype=torch.float16, num_splits=5)
    assert rel_err(fused, ref) < TOL[torch.float16]


def test_decode_fused_merge_leaves_counters_at_zero_and_reuses_them():
    # a second call on the same counters must merge again (the first left them at 0)
    counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    for seed in (90, 91):
        fused, _, ref = _decode_both_merges(seed, [50, 3, 129], 16, 2, 4, 64, torch.float32, num_splits=6,
                                            counters=counters)
        assert rel_err(fused, ref) < TOL[torch.float32]
        assert (counters == 0).all()


def test_decode_rejects_counters_of_the_wrong_type_or_size():
    from simkv.gpu.kernels import DecodeConfig, decode_config
    fused = DecodeConfig(**{**decode_config(16, 64, torch.float32).__dict__, "fused_merge": True})
    gen = torch.Generator().manual_seed(92)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, [20, 30], 16, 2, 64, torch.float32)
    q = torch.randn(2, 8, 64, generator=gen).to(DEVICE)
    for bad in (torch.zeros(4, dtype=torch.float32, device=DEVICE), torch.zeros(3, dtype=torch.int32, device=DEVICE)):
        with pytest.raises(ValueError, match="counters"):
            paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_splits=2, counters=bad,
                                   config=fused)


@pytest.mark.parametrize("num_splits", [2, 3, 40])
def test_decode_fused_merge_leaves_padding_rows_untouched(num_splits):
    from simkv.gpu.kernels import DecodeConfig

    gen = torch.Generator().manual_seed(93)
    k_cache, v_cache, block_tables, _ = make_paged(gen, [40, 40, 40, 40], 16, 2, 64, torch.float32)
    seq_lens = torch.tensor([0, 40, 0, 17], dtype=torch.int32, device=DEVICE)
    q = torch.randn(4, 8, 64, generator=gen).to(DEVICE)
    out = torch.full_like(q, 7.0)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out=out, num_splits=num_splits,
                           config=DecodeConfig(fused_merge=True, num_warps=4), counters=counters)
    ref = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out=torch.full_like(q, 7.0))
    assert (out[[0, 2]] == 7.0).all()
    assert rel_err(out, ref) < TOL[torch.float32]
    assert (counters == 0).all()


def test_split_counters_are_zero_grow_and_keep_old_buffers():
    from simkv.gpu.kernels import decode as decode_mod

    device = torch.device(DEVICE)
    held = decode_mod._COUNTERS.pop(device, None)
    try:
        small = decode_mod.split_counters(device, 10)
        assert small.dtype == torch.int32 and small.numel() >= 10 and (small == 0).all()
        assert decode_mod.split_counters(device, small.numel()) is small
        big = decode_mod.split_counters(device, small.numel() + 1)
        assert big.numel() > small.numel() and (big == 0).all()
        assert decode_mod._COUNTERS[device] == [small, big]   # graphs captured with `small` keep it
    finally:
        decode_mod._COUNTERS.pop(device, None)
        if held is not None:
            decode_mod._COUNTERS[device] = held


# -- prefill variants: block-table loads left to the pipeliner, 64-bit offsets --------------


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("prefetch", [True, False])
def test_prefill_page_loading_variants(block_size, prefetch):
    # BLOCK_N 16: block 8 spans two pages per key tile, 16 and 32 hold whole tiles (one page load)
    config = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, prefetch_pages=prefetch)
    gen = torch.Generator().manual_seed(100 + block_size)
    q_lens, cached = [1, 15, 16, 17, 40], [0, 9, 16, 33, 0]
    lens = [a + b for a, b in zip(q_lens, cached)]
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, lens, block_size, 2, 64, torch.float32)
    starts = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), 8, 64, generator=gen).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, block_tables, starts, seq_lens, out=out, config=config)
    ref = reference.paged_prefill_attention(q, k_cache, v_cache, block_tables, starts, seq_lens)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_kernels_agree_with_64_bit_offsets(monkeypatch):
    # caches too large for int32 offsets take the int64 path; force it on small ones
    from simkv.gpu.kernels import decode as decode_mod
    from simkv.gpu.kernels import prefill as prefill_mod

    gen = torch.Generator().manual_seed(110)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, [20, 45], 8, 2, 64, torch.float32)
    q = torch.randn(2, 8, 64, generator=gen).to(DEVICE)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    results = []
    for fits in (True, False):
        monkeypatch.setattr(decode_mod, "offsets_fit_int32", lambda *caches, fits=fits: fits)
        monkeypatch.setattr(prefill_mod, "offsets_fit_int32", lambda *caches, fits=fits: fits)
        results.append((
            paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_splits=2),
            paged_prefill_attention(q, k_cache, v_cache, block_tables, starts, seq_lens, config=SMALL_PREFILL),
        ))
    ref = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    for decode_out, prefill_out in results:
        assert rel_err(decode_out, ref) < TOL[torch.float32]
        assert rel_err(prefill_out, ref) < TOL[torch.float32]   # one new token: decode


def test_offsets_fit_int32_reads_the_caches_extent():
    from simkv.gpu.kernels._common import offsets_fit_int32

    small = torch.empty(100, 16, 8, 128, device="meta")
    large = torch.empty(2**20, 16, 8, 128, device="meta")     # 2**34 elements
    assert offsets_fit_int32(small, small)
    assert not offsets_fit_int32(small, large)
    assert not offsets_fit_int32(large.as_strided((2, 16, 8, 128), (2**31, 1024, 128, 1)))
