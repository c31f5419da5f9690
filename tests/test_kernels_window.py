"""Sliding-window attention in the paged kernels matches the torch reference, and the kernels
never read the tokens before the window: those slots hold NaN in the kernels' caches (any read
of them would reach the output), while the reference runs on the clean caches.

Runs under Triton's CPU interpreter without a GPU (tests.test_kernels sets it up).
"""

import pytest

from tests.test_kernels import DEVICE, SMALL_PREFILL, TOL, make_paged, rel_err, torch  # noqa: F401

from simkv.gpu import reference  # noqa: E402
from simkv.gpu.kernels import DecodeConfig, PrefillConfig, paged_decode_attention, paged_prefill_attention  # noqa: E402


def poison_before(cache, block_tables, firsts):
    """A copy of `cache` whose slots of sequence s before position firsts[s] hold NaN."""
    cache = cache.clone()
    block_size = cache.shape[1]
    for s, first in enumerate(firsts):
        for pos in range(first):
            cache[int(block_tables[s, pos // block_size]), pos % block_size] = float("nan")
    return cache


def check_decode_window(seed, lens, window, block_size=8, num_kv_heads=2, group=4, head_dim=64,
                        dtype=torch.float32, num_splits=None, config=None):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    firsts = [max(0, n - window) for n in lens]
    k_bad, v_bad = poison_before(k_cache, block_tables, firsts), poison_before(v_cache, block_tables, firsts)
    counts = torch.zeros(len(lens), 2, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_bad, v_bad, block_tables, seq_lens, out=out, num_splits=num_splits,
                           config=config, window=window, load_counts=counts)
    ref = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens,
                                           window=window)
    assert rel_err(out, ref) < TOL[dtype]
    return counts


@pytest.mark.parametrize("window", [1, 8, 9, 1000])
def test_decode_window_matches_the_reference_and_skips_the_tokens_before_it(window):
    check_decode_window(1, [1, 7, 8, 9, 30, 64, 77], window)


@pytest.mark.parametrize("num_splits", [3])
def test_decode_window_split_k_gives_the_same_answer(num_splits):
    check_decode_window(2, [3, 40, 100, 129], 33, block_size=16, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [3])
def test_decode_window_with_the_in_kernel_merge(num_splits):
    config = DecodeConfig(tile=16, num_warps=4, num_stages=2, fused_merge=True)
    check_decode_window(3, [5, 50, 97], 24, block_size=8, num_splits=num_splits, config=config)


def test_decode_window_in_half_precision():
    check_decode_window(4, [10, 90], 40, block_size=16, dtype=torch.float16)


def test_decode_reads_only_the_pages_its_window_overlaps():
    # block 8, window 20: context 77 attends to 57..76, pages 7..9 (3 pages); context 16 to
    # 0..15 (2 pages); context 5 to 0..4 (1 page); every count is per KV head (2 here).
    counts = check_decode_window(5, [77, 16, 5], 20, num_splits=1)
    assert counts[:, 0].tolist() == [2 * 20, 2 * 16, 2 * 5]
    assert counts[:, 1].tolist() == [2 * 3, 2 * 2, 2 * 1]


def test_decode_without_a_window_reads_every_page():
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, [77, 16], 8, 2, 64, torch.float32)
    q = torch.randn(2, 8, 64, generator=gen).to(DEVICE)
    counts = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_splits=1, load_counts=counts)
    assert counts.tolist() == [[2 * 77, 2 * 10], [2 * 16, 2 * 2]]


def test_decode_split_programs_count_a_page_they_share_once_each():
    # tile 16 over block 32: splits cut inside pages, and each program reads its part of a page
    config = DecodeConfig(tile=16, num_warps=4, num_stages=2)
    one = check_decode_window(7, [200], 100, block_size=32, num_splits=1, config=config)
    three = check_decode_window(7, [200], 100, block_size=32, num_splits=3, config=config)
    assert one[0, 0] == three[0, 0] == 2 * 100
    assert one[0, 1] == 2 * 4                  # positions 100..199: pages 3..6
    assert three[0, 1] == 2 * 5              # splits 96..143, 144..191, 192..199: page 4 twice


def test_a_window_below_one_token_is_refused():
    gen = torch.Generator().manual_seed(8)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, [4], 8, 1, 16, torch.float32)
    q = torch.randn(1, 1, 16, generator=gen).to(DEVICE)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, window=0)
    with pytest.raises(ValueError, match="window"):
        paged_prefill_attention(q, k_cache, v_cache, block_tables, starts, seq_lens, window=0)


def check_prefill_window(seed, q_lens, cached, window, block_size=8, num_kv_heads=2, group=2, head_dim=64,
                         dtype=torch.float32, config=SMALL_PREFILL):
    gen = torch.Generator().manual_seed(seed)
    lens = [a + b for a, b in zip(q_lens, cached)]
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, lens, block_size, num_kv_heads, head_dim, dtype)
    starts = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype).to(DEVICE)
    # no new token sees a key before its chunk's first token's window
    firsts = [max(0, c - window + 1) if n else 0 for n, c in zip(q_lens, cached)]
    k_bad, v_bad = poison_before(k_cache, block_tables, firsts), poison_before(v_cache, block_tables, firsts)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_bad, v_bad, block_tables, starts, seq_lens, out=out, config=config, window=window)
    ref = reference.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, starts,
                                            seq_lens, window=window)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("window", [1, 23, 500])
def test_prefill_window_without_a_cached_prefix(window):
    check_prefill_window(10, [1, 16, 17, 45], [0] * 4, window)


@pytest.mark.parametrize("window", [1, 40])
def test_prefill_window_over_a_cached_prefix_skips_what_no_new_token_sees(window):
    check_prefill_window(11, [5, 33, 1, 20, 0], [60, 7, 50, 0, 30], window)


@pytest.mark.parametrize(("block_size", "prefetch"), [(8, True), (32, False)])
def test_prefill_window_page_loading_variants(block_size, prefetch):
    config = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=2, prefetch_pages=prefetch)
    check_prefill_window(12, [40, 3], [37, 70], 20, block_size=block_size, config=config)


def test_prefill_window_in_half_precision_with_gqa():
    check_prefill_window(13, [30, 12], [20, 41], 24, block_size=16, num_kv_heads=1, group=8,
                         dtype=torch.float16)
