"""The paged-cache kernels at realistic scale on a CUDA GPU (bf16 and fp32), against the reference.

Run in its own process (`pytest tests/gpu`): if tests/test_kernels.py was imported first on a
machine without CUDA it switched Triton to its interpreter; these tests then skip.
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from simkv.gpu import reference  # noqa: E402
from simkv.gpu.kernels import (  # noqa: E402
    INTERPRET,
    DecodeConfig,
    PrefillConfig,
    copy_blocks,
    decode_num_splits,
    decode_config,
    decode_workspace_numel,
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
)
from simkv.gpu.swap import HostSwapSpace, swap_in, swap_out  # noqa: E402

if INTERPRET:
    pytest.skip("kernels were imported under TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def rel_err(out, ref):
    assert not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_paged(gen, lens, block_size, num_kv_heads, head_dim, dtype):
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * max_blocks + 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    order = torch.randperm(num_blocks, generator=gen, device=DEVICE)[: len(lens) * max_blocks]
    block_tables = order.view(len(lens), max_blocks).to(torch.int32)
    return k_cache, v_cache, block_tables, torch.tensor(lens, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128, 256])
def test_decode_at_scale(dtype, block_size):
    gen = torch.Generator(device=DEVICE).manual_seed(block_size)
    lens = [1, block_size - 1, block_size, block_size + 1, 4096, 5000] + torch.randint(
        1, 3000, (26,), generator=gen, device=DEVICE).tolist()
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, lens, block_size, 8, 128, dtype)
    q = torch.randn(len(lens), 32, 128, generator=gen, device=DEVICE).to(dtype)
    for num_splits in (None, 1, 5):
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out=out, num_splits=num_splits)
        ref = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens)
        assert rel_err(out, ref) < TOL[dtype], num_splits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_gqa_and_head_dim_64(dtype, group):
    gen = torch.Generator(device=DEVICE).manual_seed(group)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, [1, 17, 700, 2049], 16, 4, 64, dtype)
    q = torch.randn(4, 4 * group, 64, generator=gen, device=DEVICE).to(dtype)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    ref = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens)
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_batch_one_uses_many_splits():
    assert decode_num_splits(1, 8, 4096, decode_config(16, 128, torch.bfloat16).tile, 132) >= 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_prefill_at_scale(dtype, block_size):
    gen = torch.Generator(device=DEVICE).manual_seed(100 + block_size)
    q_lens, cached = [1, 300, 1000, 77, 513], [0, 500, 2048, 3, 0]
    lens = [a + b for a, b in zip(q_lens, cached)]
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, lens, block_size, 8, 128, dtype)
    starts = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), 32, 128, generator=gen, device=DEVICE).to(dtype)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, block_tables, starts, seq_lens, out=out)
    ref = reference.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, starts, seq_lens)
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_replays_in_a_cuda_graph_with_new_lengths():
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, [4096] * 8, 16, 8, 128, torch.bfloat16)
    q = torch.randn(8, 32, 128, generator=gen, device=DEVICE).to(torch.bfloat16)
    out = torch.empty_like(q)
    splits = decode_num_splits(8, 8, block_tables.shape[1] * 16, decode_config(16, 128, q.dtype).tile, 132)
    workspace = torch.empty(decode_workspace_numel(8, 32, 128, splits), device=DEVICE)
    call = lambda: paged_decode_attention(  # noqa: E731
        q, k_cache, v_cache, block_tables, seq_lens, out=out, workspace=workspace, num_splits=splits)
    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    # replays merge again each time: the in-kernel merge's counters are back at 0 after each
    for lens in ([1, 15, 16, 17, 1000, 2048, 4000, 4096], [4096, 0, 3, 0, 2049, 1, 700, 64]):
        seq_lens.copy_(torch.tensor(lens, device=DEVICE, dtype=torch.int32))
        q.normal_(generator=gen)
        out.fill_(7.0)
        graph.replay()
        ref = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens,
                                               out=torch.full_like(q, 7.0))
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        assert (out[seq_lens == 0] == 7.0).all()


def test_reshape_and_cache_and_copy_blocks_at_scale():
    gen = torch.Generator(device=DEVICE).manual_seed(8)
    k_cache = torch.randn(1000, 16, 8, 128, generator=gen, device=DEVICE).to(torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    key = torch.randn(3000, 8, 128, generator=gen, device=DEVICE).to(torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(16000, generator=gen, device=DEVICE)[:3000]
    slots[::7] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reference.reshape_and_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    mapping = torch.stack([torch.arange(0, 100), torch.arange(500, 600)], dim=1).to(DEVICE)
    copy_blocks(k_cache, v_cache, mapping)
    reference.copy_blocks(k_ref, v_ref, mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_swap_round_trip_through_pinned_memory():
    stack = torch.randn(4, 2, 64, 16, 8, 128, device=DEVICE).to(torch.bfloat16)
    space = HostSwapSpace.allocate(32, stack)
    assert space.blocks.is_pinned()
    original = stack.clone()
    swap_out(stack, space, [(d, 10 + i) for i, d in enumerate(range(40, 60))])
    stack[:, :, 40:60] = 0
    swap_in(stack, space, [(d, 10 + i) for i, d in enumerate(range(40, 60))])
    torch.cuda.synchronize()
    assert torch.equal(stack, original)


@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_of_a_single_sequence(num_splits):
    # integer kernel arguments equal to 1 are special to Triton's compiler (not to its interpreter)
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, [3000], 16, 8, 128, torch.bfloat16)
    q = torch.randn(1, 32, 128, generator=gen, device=DEVICE).to(torch.bfloat16)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, num_splits=num_splits)
    ref = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("q_len, cached", [(1, 0), (1, 700), (333, 0), (200, 1000)])
def test_prefill_of_a_single_sequence(q_len, cached):
    gen = torch.Generator(device=DEVICE).manual_seed(10)
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, [q_len + cached], 16, 8, 128, torch.bfloat16)
    starts = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
    q = torch.randn(q_len, 32, 128, generator=gen, device=DEVICE).to(torch.bfloat16)
    out = paged_prefill_attention(q, k_cache, v_cache, block_tables, starts, seq_lens)
    ref = reference.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, starts, seq_lens)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("num_splits", [2, 3, 33, 128])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_decode_fused_merge_matches_the_merge_kernel_at_scale(num_splits, batch):
    gen = torch.Generator(device=DEVICE).manual_seed(num_splits * 10 + batch)
    lens = ([4096, 1, 17, 16384, 15, 16, 3000, 8191])[:batch]
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, lens, 16, 8, 128, torch.bfloat16)
    q = torch.randn(batch, 32, 128, generator=gen, device=DEVICE).to(torch.bfloat16)
    base = decode_config(16, 128, torch.bfloat16)
    outs = []
    for fused in (True, False):
        cfg = DecodeConfig(base.tile, base.num_warps, base.num_stages, fused_merge=fused)
        out = torch.full_like(q, float("nan"))
        for _ in range(3):  # repeated calls reuse the shared counters
            paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out=out, num_splits=num_splits,
                                   config=cfg)
        outs.append(out)
    ref = reference.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, seq_lens)
    assert rel_err(outs[0], ref) < TOL[torch.bfloat16]
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("tiles", [(128, 64, 8, 3), (64, 128, 4, 2), (128, 32, 4, 4)])
def test_prefill_tile_and_page_loading_variants(block_size, prefetch, tiles):
    gen = torch.Generator(device=DEVICE).manual_seed(200 + block_size)
    q_lens, cached = [1, 300, 1000, 77, 513], [0, 500, 2048, 3, 0]
    lens = [a + b for a, b in zip(q_lens, cached)]
    k_cache, v_cache, block_tables, seq_lens = make_paged(gen, lens, block_size, 8, 128, torch.bfloat16)
    starts = torch.tensor([0] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), 32, 128, generator=gen, device=DEVICE).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    config = PrefillConfig(*tiles, prefetch_pages=prefetch)
    paged_prefill_attention(q, k_cache, v_cache, block_tables, starts, seq_lens, out=out, config=config)
    ref = reference.paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), block_tables, starts, seq_lens)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
