"""Mixture-of-experts feed-forward for the sample model: router top-k and grouped expert GEMMs.

    weights, ids = route(h, router, cfg)                  # [T, top_k] float32, int32
    weights, ids = fused_route(h, router, cfg)            # the same, softmax + top-k in Triton
    out = fused_moe(h, w_gate_up, w_down, weights, ids)   # Triton: two grouped GEMM launches
    out = reference_moe(h, w_gate_up, w_down, weights, ids)   # plain torch, expert by expert

Expert weights of one layer are stacked: w_gate_up [E, 2 I, H] (gate rows, then up rows),
w_down [E, H, I]; an expert computes down(silu(gate x) * up x), as Qwen3-MoE and Mixtral do.

`fused_moe` sorts the T × top_k (token, expert) pairs by expert and pads each expert's run to a
multiple of BLOCK_M (`align_pairs`, torch ops of fixed shapes: no host sync, CUDA-graph safe).
One program of the grouped GEMM takes BLOCK_M pairs of one expert and BLOCK_N output columns:
an expert's weights are read once per column tile whatever its number of tokens, and the padding
blocks past the last expert read nothing. The first launch computes gate and up tiles together
and writes silu(gate) * up; the second the down projection scaled by each pair's routing weight;
the top_k rows of a token are then summed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Architectures whose routing and experts the sample model computes. gpt-oss (router bias,
# clamped SwiGLU, attention sinks) and DeepSeek-V3 (grouped sigmoid routing, MLA) are not.
MOE_SAMPLE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class RouterConfig:
    """How a layer's router picks experts: softmax over all `num_experts` logits, the `top_k`
    largest kept, renormalised to sum to 1 when `renormalize` (Qwen3's `norm_topk_prob`;
    Mixtral's softmax over its top-k logits is the same thing)."""

    num_experts: int
    top_k: int
    renormalize: bool


def router_config(spec) -> RouterConfig:
    """The router of a MoE model spec, from its config.json where the spec does not say
    (Qwen3-MoE's `norm_topk_prob`, default false as in transformers). Raises ValueError for an
    architecture the sample model does not compute."""
    if spec.architecture not in MOE_SAMPLE_ARCHITECTURES:
        raise ValueError(f"{spec.name}: the sample model computes the experts of "
                         f"{', '.join(MOE_SAMPLE_ARCHITECTURES)}, not {spec.architecture}")
    e = spec.experts
    if e.num_shared_experts:
        raise ValueError(f"{spec.name}: shared experts are not in the sample model")
    if spec.architecture == "MixtralForCausalLM":
        renormalize = True
    else:
        config = json.loads(spec.path.read_text()) if spec.path is not None else {}
        renormalize = bool(config.get("norm_topk_prob", False))
    return RouterConfig(e.num_experts, e.top_k, renormalize)


def route(h: torch.Tensor, router: torch.Tensor, cfg: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of tokens h [T, H] by router weights [E, H]: (weights float32 [T, top_k],
    expert ids int32 [T, top_k]), the experts in descending order of probability."""
    compute = torch.float64 if h.dtype == torch.float64 else torch.float32
    probs = torch.softmax(F.linear(h, router).to(compute), dim=-1)
    weights, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(compute), ids.to(torch.int32)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, stride_l, num_experts,
                  TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr):
    # One token: softmax over the experts, then TOP_K times the largest probability taken out.
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, E_PAD)
    x = tl.load(logits_ptr + t * stride_l + offs_e, mask=offs_e < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    offs_k = tl.arange(0, K_PAD)
    top_w = tl.zeros([K_PAD], tl.float32)
    top_id = tl.zeros([K_PAD], tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        pick = tl.argmax(p, 0)
        top_w = tl.where(offs_k == i, best, top_w)
        top_id = tl.where(offs_k == i, pick.to(tl.int32), top_id)
        p = tl.where(offs_e == pick, -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 0)
    tl.store(weights_ptr + t * TOP_K + offs_k, top_w, mask=offs_k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + offs_k, top_id, mask=offs_k < TOP_K)


def fused_route(h: torch.Tensor, router: torch.Tensor, cfg: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` with the softmax and top-k in one Triton launch after the router's matmul."""
    logits = F.linear(h, router)
    num_tokens = h.shape[0]
    weights = torch.empty((num_tokens, cfg.top_k), dtype=torch.float32, device=h.device)
    ids = torch.empty((num_tokens, cfg.top_k), dtype=torch.int32, device=h.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](logits, weights, ids, logits.stride(0), cfg.num_experts,
                                     TOP_K=cfg.top_k, K_PAD=triton.next_power_of_2(cfg.top_k),
                                     E_PAD=triton.next_power_of_2(cfg.num_experts), RENORMALIZE=cfg.renormalize,
                                     num_warps=1 if cfg.num_experts <= 256 else 4)
    return weights, ids


def reference_moe(h, w_gate_up, w_down, weights, ids) -> torch.Tensor:
    """Plain torch: each expert over the tokens routed to it, outputs summed by routing weight;
    computed in float32 (float64 for float64 inputs), returned in h's dtype."""
    compute = torch.float64 if h.dtype == torch.float64 else torch.float32
    inter = w_down.shape[2]
    out = torch.zeros(h.shape, dtype=compute, device=h.device)
    x = h.to(compute)
    for e in torch.unique(ids).tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        gu = x[token] @ w_gate_up[e].to(compute).T
        act = F.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, token, (act @ w_down[e].to(compute).T) * weights[token, slot, None].to(compute))
    return out.to(h.dtype)


# ----------------------------------------------------------------------------------------------
# Grouped GEMM over (token, expert) pairs sorted by expert


@dataclass(frozen=True)
class MoeConfig:
    """Launch parameters of the grouped expert GEMMs (pairs per program, output columns per
    program, reduction step, warps, pipeline depth)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def moe_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeConfig:
    """BLOCK_M 16 while an expert gets a few pairs (decode), 64 once it gets many (prefill):
    padding an expert's run to BLOCK_M wastes little either way. fp32 (IEEE dots on FMA units):
    smaller tiles, from the compiler's register use, not timed."""
    if dtype == torch.float32:
        return MoeConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    if num_pairs <= 16 * num_experts:
        return MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
    return MoeConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M blocks the pairs can fill once each expert's run is padded."""
    return min(-(-num_pairs // block_m) + num_experts, num_pairs)


@triton.jit
def _align_kernel(ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_blocks,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    # One program: count the pairs of each expert, lay the padded runs out, then place each pair
    # after the earlier pairs of its expert (so runs keep the pairs in index order).
    offs_e = tl.arange(0, E_PAD)
    offs_c = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], tl.int32)
    for c in range(0, tl.cdiv(num_pairs, CHUNK)):
        pair = c * CHUNK + offs_c
        e = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
        counts += tl.sum((e[:, None] == offs_e[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    total = tl.sum(padded, 0)
    for c in range(0, tl.cdiv(num_blocks * BLOCK_M, CHUNK)):
        slot = c * CHUNK + offs_c
        tl.store(sorted_pairs_ptr + slot, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=slot < num_blocks * BLOCK_M)
    tl.debug_barrier()   # the padding is written before the pairs overwrite their slots
    running = tl.zeros([E_PAD], tl.int32)
    for c in range(0, tl.cdiv(num_pairs, CHUNK)):
        pair = c * CHUNK + offs_c
        valid = pair < num_pairs
        e = tl.load(ids_ptr + pair, mask=valid, other=-1)
        onehot = (e[:, None] == offs_e[None, :]).to(tl.int32)               # [CHUNK, E_PAD]
        earlier = tl.cumsum(onehot, 0) - onehot + running[None, :] + pad_start[None, :]
        tl.store(sorted_pairs_ptr + tl.sum(earlier * onehot, 1), pair, mask=valid)
        running += tl.sum(onehot, 0)
    for c in range(0, tl.cdiv(num_blocks, CHUNK)):
        block = c * CHUNK + offs_c
        start = block * BLOCK_M
        expert = tl.sum((pad_end[None, :] <= start[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + block, tl.where(start < total, expert, -1), mask=block < num_blocks)


# Above this many pairs the torch ops lay the pairs out (one program would take long); below,
# one Triton launch replaces their ~20.
ALIGN_KERNEL_MAX_PAIRS = 16384


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int, use_kernel: bool | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs int32 [blocks × block_m], block_expert int32 [blocks]): the pair indices
    (token × top_k + slot) grouped by expert in index order, each expert's run padded to a
    multiple of block_m with the index num_pairs; the expert of each block, -1 for the blocks
    past the last run. Shapes depend only on ids.shape, num_experts and block_m. `use_kernel`:
    one Triton program (default for up to ALIGN_KERNEL_MAX_PAIRS pairs) or torch ops."""
    num_pairs = ids.numel()
    if use_kernel is None:
        use_kernel = num_pairs <= ALIGN_KERNEL_MAX_PAIRS
    if use_kernel:
        blocks = max_blocks(num_pairs, num_experts, block_m)
        sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=ids.device)
        block_expert = torch.empty(blocks, dtype=torch.int32, device=ids.device)
        if blocks:
            e_pad = max(16, triton.next_power_of_2(num_experts))
            _align_kernel[(1,)](ids.reshape(-1).to(torch.int32), sorted_pairs, block_expert, num_pairs, blocks,
                                BLOCK_M=block_m, E_PAD=e_pad, CHUNK=max(16, 8192 // e_pad), num_warps=4)
        return sorted_pairs, block_expert
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert]
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[(pad_end - padded)[expert] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True)
    block_expert = torch.where(starts < pad_end[-1], block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, pair_weights_ptr,
    N, K, num_pairs,
    stride_a, stride_we, stride_wn, stride_out,
    ROWS_PER_A: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    # out[pair, n] = sum_k a[pair // ROWS_PER_A, k] * w[expert, n, k] over BLOCK_M pairs of one
    # expert; GATED: w holds gate rows [0, N) then up rows [N, 2N), out = silu(gate) * up;
    # WEIGHTED: out scaled by the pair's routing weight.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    # A padding block (expert -1) runs no iteration, so it reads no weights, and stores nothing
    # (its pairs are all num_pairs). A loop bound rather than a branch keeps the loop pipelined.
    k_hi = tl.where(expert >= 0, K, 0)
    expert = tl.maximum(expert, 0)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < num_pairs
    a_rows = (pairs // ROWS_PER_A).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + offs_k[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + offs_k[None, :], mask=w_mask, other=0.0)              # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        if GATED:
            w_up = tl.load(w_rows + N * stride_wn + offs_k[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(a, tl.trans(w_up), acc_up, input_precision=PRECISION)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if WEIGHTED:
        acc = acc * tl.load(pair_weights_ptr + pairs, mask=pair_ok, other=0.0)[:, None]
    o_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])


def _grouped_gemm(a, w, out, sorted_pairs, block_expert, pair_weights, rows_per_a, gated, cfg, n):
    blocks = block_expert.shape[0]
    if blocks == 0:
        return out
    _moe_gemm_kernel[(blocks, triton.cdiv(n, cfg.block_n))](
        a, w, out, sorted_pairs, block_expert, pair_weights,
        n, a.shape[1], out.shape[0],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_PER_A=rows_per_a, GATED=gated, WEIGHTED=pair_weights is not None and not gated,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee",   # ignored for 16-bit inputs; exact fp32 for the CPU tests
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def fused_moe(h: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, config: MoeConfig | None = None) -> torch.Tensor:
    """The routed experts' output [T, H] (h's dtype) for tokens h [T, H] routed to `ids`
    [T, top_k] with `weights` [T, top_k]; w_gate_up [E, 2 I, H], w_down [E, H, I], each with
    contiguous rows. Two grouped-GEMM launches and a sum over top_k; no host sync."""
    num_tokens, hidden = h.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    top_k = ids.shape[1]
    num_pairs = num_tokens * top_k
    if h.stride(1) != 1 or w_gate_up.stride(2) != 1 or w_down.stride(2) != 1:
        raise ValueError("fused_moe needs h and the expert weights contiguous in their last dimension")
    cfg = config or moe_config(num_pairs, num_experts, h.dtype)
    sorted_pairs, block_expert = align_pairs(ids, num_experts, cfg.block_m)
    act = torch.empty((num_pairs, inter), dtype=h.dtype, device=h.device)
    _grouped_gemm(h, w_gate_up, act, sorted_pairs, block_expert, None, top_k, True, cfg, inter)
    pair_out = torch.empty((num_pairs, hidden), dtype=h.dtype, device=h.device)
    pair_weights = weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, w_down, pair_out, sorted_pairs, block_expert, pair_weights, 1, False, cfg, hidden)
    return pair_out.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(h.dtype)


def touched_experts(ids: torch.Tensor, num_experts: int) -> int:
    """Distinct experts the routed pairs use (host sync: benchmarks only)."""
    return int(torch.bincount(ids.reshape(-1).long(), minlength=num_experts).count_nonzero())
