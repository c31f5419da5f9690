"""Launch policies of the paged kernels that the cost model must reproduce (no torch, no triton).

The simulator's profiled cost model predicts the decode kernel's busiest program from the same
split rule the kernel launches with, so the rule lives here, importable without the GPU extra.
"""
from __future__ import annotations


# Token counts of the engine's captured mixed (prefill + decode) steps (simkv.gpu.executor). The
# linear layers' time is nearly flat up to ~512 tokens on an H200 (profiles/h200/*/fit.json), so
# the steps are coarse there and finer above, where padding costs device time. Up to 2,048
# tokens: a 1B's eager steps of 1,024-2,048 tokens are host-bound (~8 ms of launches over 4-8 ms
# of device work) and took up to twice as long in the host's slow spells (p10-p90 spread 35-55%;
# research/eager_noise.py); graphed, the launches are one. Steps with prefill chunks and more
# tokens than the largest run eagerly.
MIXED_TOKEN_SIZES = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1152, 1280, 1408, 1536,
                     1664, 1792, 1920, 2048)
# Decode-only steps run as CUDA graphs at these batch sizes (up to max_num_seqs).
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def decode_graph_sizes(max_num_seqs: int, sizes=GRAPH_BATCH_SIZES) -> list:
    """The batch sizes an engine with this max_num_seqs captures (the last one is the cap),
    from the engine's list of `sizes` (a profile's own list: the engine version it measured)."""
    top = min(max_num_seqs, sizes[-1])
    return [b for b in sizes if b < top] + [top]


def mixed_graph_sizes(max_num_batched_tokens: int, sizes=MIXED_TOKEN_SIZES) -> list:
    """The token counts of the mixed steps an engine with this token budget captures, from the
    engine's list of `sizes` (a profile's own list: an engine version that captured others)."""
    top = min(max_num_batched_tokens, sizes[-1])
    return [t for t in sizes if t < top] + [top]


# Split-K policy: a batch that gives at least FULL_PROGRAMS_PER_SM programs per SM runs unsplit
# (measured on an H200: at batch 64 × 4096 one split beat 2, 3, 4 and 8); a smaller one is split
# towards SPLIT_PROGRAMS_PER_SM programs per SM, each split keeping at least MIN_TILES_PER_SPLIT
# tiles (4 and 2: the best geometric mean against SDPA at batch 1/4/8 x 4,096/16,384 in the bounded
# tune on an H200, profiles/h200/kernels-tuned/best.json; `simkv bench tune --quick`
# sweeps them again).
FULL_PROGRAMS_PER_SM = 2
SPLIT_PROGRAMS_PER_SM = 4
MIN_TILES_PER_SPLIT = 2


def decode_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    tile: int,
    num_sms: int,
    *,
    split_programs_per_sm: int | None = None,
    min_tiles_per_split: int | None = None,
) -> int:
    """Splits per sequence for a decode call; depends only on shapes, so CUDA graphs can hold it.

    `max_context` is the longest context the block tables can address (max_blocks_per_seq ×
    block_size); `tile` the kernel's tokens per iteration (`decode_config(...).tile`).
    """
    programs = num_seqs * num_kv_heads
    if programs >= FULL_PROGRAMS_PER_SM * num_sms:
        return 1
    per_sm = SPLIT_PROGRAMS_PER_SM if split_programs_per_sm is None else split_programs_per_sm
    min_tiles = MIN_TILES_PER_SPLIT if min_tiles_per_split is None else min_tiles_per_split
    max_tiles = max(1, -(-max_context // tile))
    want = -(-per_sm * num_sms // max(1, programs))
    return int(max(1, min(want, max_tiles // min_tiles, 256)))
