"""The sample model's fused elementwise Triton kernels (the Triton backend's; `simkv.gpu.model`
launches them): residual add + RMSNorm, RoPE, the per-head q/k RMSNorm, and the gated MLP's
activation times its up projection (SiLU, or GELU's tanh form). Each program handles one token's
row (the activation: one block of it); arithmetic in float32, stored in the tensors' dtype."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, stride_x, stride_delta, stride_out,
                        n_cols, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x = x + tl.load(delta_ptr + row * stride_delta + offs, mask=mask, other=0.0).to(tl.float32)
        x_stored = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + offs, x_stored, mask=mask)
        x = x_stored.to(tl.float32)   # normalise what the residual stream holds
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (x * inv_rms * w).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def rope_kernel(x_ptr, pos_ptr, inv_freq_ptr, stride_tok, num_heads,
                HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.float32)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_i = tl.arange(0, HALF_PAD)
    inv_freq = tl.load(inv_freq_ptr + offs_i, mask=offs_i < HALF, other=0.0)
    angle = pos * inv_freq
    cos = tl.cos(angle)[None, :]
    sin = tl.sin(angle)[None, :]
    mask = (offs_h < num_heads)[:, None] & (offs_i < HALF)[None, :]
    ptr = x_ptr + tok * stride_tok + offs_h[:, None] * (2 * HALF) + offs_i[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def head_rms_norm_kernel(x_ptr, q_w_ptr, k_w_ptr, stride_tok, num_q_heads, num_heads, eps,
                         HEADS_PAD: tl.constexpr, D: tl.constexpr):
    # Qwen3's and Gemma 3's per-head RMSNorm of one token's q heads, then k heads (contiguous),
    # in place.
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, D)
    mask = (offs_h < num_heads)[:, None]
    ptr = x_ptr + tok * stride_tok + offs_h[:, None] * D + offs_d[None, :]
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)
    w_q = tl.load(q_w_ptr + offs_d).to(tl.float32)
    w_k = tl.load(k_w_ptr + offs_d).to(tl.float32)
    w = tl.where((offs_h < num_q_heads)[:, None], w_q[None, :], w_k[None, :])
    tl.store(ptr, (x * inv_rms[:, None] * w).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def act_and_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr,
                       GELU_TANH: tl.constexpr):
    # act(gate) * up: SiLU (g * sigmoid(g)), or GELU's tanh approximation, which is
    # g * sigmoid(2 u) with u = sqrt(2 / pi) (g + 0.044715 g^3), as 0.5 (1 + tanh u) = sigmoid(2 u)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU_TANH:
        z = 1.5957691216057308 * (g + 0.044715 * g * g * g)     # 2 sqrt(2 / pi) (...)
    else:
        z = g
    out = g / (1.0 + tl.exp(-z)) * u
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
