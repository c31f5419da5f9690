"""The sample model's mixture-of-experts stack (simkv.gpu.moe) on CPU.

The fused grouped GEMMs run under Triton's CPU interpreter; the engine with a tiny Qwen3-MoE
config (2 layers, 8 experts, top 2) must generate, greedily and in float32, the tokens of a
plain torch model written out below (whole-sequence causal attention, every token sent through
its experts one by one), which shares nothing with the engine but the weights.
"""
import json
import math
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

import simkv  # noqa: E402
from simkv.gpu.kernels import INTERPRET  # noqa: E402
from simkv.gpu.moe import (  # noqa: E402
    MoeConfig, align_pairs, fused_moe, reference_moe, route, router_config,
)
from simkv.specs import load_model  # noqa: E402

needs_kernels = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                   reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"

TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 256, "decoder_sparse_step": 1, "mlp_only_layers": [],
}


def write_config(tmp_path, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_MOE, **changes}))
    return path


def test_align_pairs_groups_pairs_by_expert_in_padded_blocks():
    # 3 tokens x top 2 = pairs 0..5 routed to experts [[2, 0], [2, 1], [0, 2]], blocks of 2:
    # expert 0 gets pairs 1, 4; expert 1 pair 3 and a pad; expert 2 pairs 0, 2, 5 and a pad
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32)
    pairs, block_expert = align_pairs(ids, num_experts=4, block_m=2, use_kernel=False)
    assert pairs.tolist()[:8] == [1, 4, 3, 6, 0, 2, 5, 6]
    assert block_expert.tolist()[:4] == [0, 1, 2, 2]
    assert all(e == -1 for e in block_expert.tolist()[4:])
    assert all(p == 6 for p in pairs.tolist()[8:])


@needs_kernels
@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m"), [(3, 2, 4, 2), (37, 4, 16, 16), (9, 8, 128, 16)])
def test_the_align_kernel_lays_pairs_out_as_the_torch_ops_do(tokens, top_k, experts, block_m):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    ids = ids.to(DEVICE)
    by_kernel = align_pairs(ids, experts, block_m, use_kernel=True)
    by_torch = align_pairs(ids, experts, block_m, use_kernel=False)
    assert by_kernel[0].tolist() == by_torch[0].tolist()
    assert by_kernel[1].tolist() == by_torch[1].tolist()


@needs_kernels
def test_fused_route_picks_and_weighs_as_route_does():
    from simkv.gpu.moe import RouterConfig, fused_route
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(11, 32, generator=gen).to(DEVICE)
    router = torch.randn(16, 32, generator=gen).to(DEVICE)
    for renormalize in (True, False):
        cfg = RouterConfig(16, 4, renormalize)
        w_ref, ids_ref = route(h, router, cfg)
        w, ids = fused_route(h, router, cfg)
        assert torch.equal(ids, ids_ref)
        torch.testing.assert_close(w, w_ref)


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_kernels)])
def test_align_pairs_shape_depends_only_on_the_shapes(use_kernel):
    device = DEVICE if use_kernel else "cpu"
    a = align_pairs(torch.zeros(5, 2, dtype=torch.int32, device=device), 4, 4, use_kernel=use_kernel)
    b = align_pairs(torch.arange(10, dtype=torch.int32, device=device).remainder(4).view(5, 2), 4, 4,
                    use_kernel=use_kernel)
    assert a[0].shape == b[0].shape and a[1].shape == b[1].shape


def test_route_renormalises_the_top_k_when_the_config_says_so(tmp_path):
    h = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    router = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    on = router_config(load_model(str(write_config(tmp_path))))
    off = router_config(load_model(str(write_config(tmp_path, norm_topk_prob=False))))
    w_on, ids_on = route(h, router, on)
    w_off, ids_off = route(h, router, off)
    probs = torch.softmax(h @ router.T, -1)
    assert torch.equal(ids_on, ids_off)
    torch.testing.assert_close(w_off, probs.gather(1, ids_off.long()))
    torch.testing.assert_close(w_on.sum(-1), torch.ones(6))
    assert (probs.gather(1, ids_on.long()[:, :1]) >= probs.max(-1, keepdim=True).values).all()


def test_the_sample_model_refuses_moe_families_it_does_not_compute():
    from simkv.gpu.model import LlamaModel
    with pytest.raises(ValueError, match="GptOssForCausalLM"):
        LlamaModel(load_model("gpt-oss-20b"), device="meta", dtype=torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize(("tokens", "config"), [
    (7, MoeConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)),
    (40, MoeConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)),
])
def test_fused_moe_matches_the_expert_by_expert_loop(tokens, config):
    # hidden 48 and width 24 are not multiples of the tiles: masked edges in N and K
    gen = torch.Generator().manual_seed(tokens)
    E, k, H, inter = 6, 2, 48, 24
    h = torch.randn(tokens, H, generator=gen).to(DEVICE)
    w_gate_up = (torch.randn(E, 2 * inter, H, generator=gen) / H ** 0.5).to(DEVICE)
    w_down = (torch.randn(E, H, inter, generator=gen) / inter ** 0.5).to(DEVICE)
    router = torch.randn(E, H, generator=gen).to(DEVICE)
    from simkv.gpu.moe import RouterConfig
    weights, ids = route(h, router, RouterConfig(E, k, True))
    out = fused_moe(h, w_gate_up, w_down, weights, ids, config)
    ref = reference_moe(h.double(), w_gate_up.double(), w_down.double(), weights.double(), ids)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


# -- the engine against a plain model ------------------------------------------------------------


def plain_logits(model, token_ids: list) -> torch.Tensor:
    """Logits of the last position of `token_ids`, computed from the model's weights with no
    cache: RMSNorm, q/k norms, RoPE, causal softmax attention (over the last `window` tokens on
    a sliding layer), each token's top-k experts."""
    spec, f32 = model.spec, torch.float32

    def w(t):                                   # the weights, in float32 on the CPU
        return t.detach().to("cpu", f32)
    H, KH, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    eps = float(spec.rms_norm_eps)
    top_k, renorm = model.router_cfg.top_k, model.router_cfg.renormalize

    def rms(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    def rope(x, pos):
        half = D // 2
        inv = 1.0 / spec.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = (pos[:, None].double() * inv[None]).to(f32)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)

    n = len(token_ids)
    pos = torch.arange(n)
    x = w(model.embed)[torch.tensor(token_ids)]
    for layer, window in zip(model.layers, model.layer_windows):
        h = rms(x, w(layer.input_norm))
        qkv = h @ w(layer.qkv).T
        q = rms(qkv[:, :H * D].view(n, H, D), w(layer.q_norm))
        k = rms(qkv[:, H * D:(H + KH) * D].view(n, KH, D), w(layer.k_norm))
        v = qkv[:, (H + KH) * D:].view(n, KH, D)
        q, k = rope(q, pos), rope(k, pos)
        attn = torch.empty(n, H, D)
        for head in range(H):
            kv = head // (H // KH)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(D)
            hidden_keys = torch.ones(n, n, dtype=torch.bool).triu(1)
            if window is not None:
                hidden_keys |= torch.ones(n, n, dtype=torch.bool).tril(-window)
            scores = scores.masked_fill(hidden_keys, float("-inf"))
            attn[:, head] = torch.softmax(scores, -1) @ v[:, kv]
        x = x + attn.reshape(n, H * D) @ w(layer.o).T
        h = rms(x, w(layer.post_norm))
        ff = torch.zeros_like(h)
        inter = layer.down.shape[2]
        router, gate_up, down = w(layer.router), w(layer.gate_up), w(layer.down)
        for t in range(n):
            probs = torch.softmax(router @ h[t], -1)
            top = torch.topk(probs, top_k)
            share = top.values / top.values.sum() if renorm else top.values
            for weight, e in zip(share.tolist(), top.indices.tolist()):
                gu = gate_up[e] @ h[t]
                ff[t] += weight * (down[e] @ (F.silu(gu[:inter]) * gu[inter:]))
        x = x + ff
    return rms(x, w(model.final_norm))[-1] @ w(model.lm_head).T


def plain_greedy(model, prompt: list, num_tokens: int) -> list:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(plain_logits(model, tokens).argmax()))
    return tokens[len(prompt):]


def moe_scenario(path, **cache):
    return simkv.load_scenario({
        "name": "moe-cpu", "model": str(path), "gpu": "h200", "seed": 0,
        "cache": {"block_size": 4, "num_gpu_blocks_override": 128, "enable_prefix_caching": False, **cache},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 48},
        "workload": {"synthetic": {"num_requests": 1, "output_tokens": 1,
                                   "prompt_tokens": {"dist": "fixed", "value": 8}}}})


@needs_kernels
def test_a_window_hybrid_engine_frees_window_blocks_and_keeps_the_plain_models_tokens(tmp_path):
    # gpt-oss's layout, tiny: sliding (8-token window) and full layers alternate, MoE feed-forward;
    # the KV manager keeps a table per group and frees window blocks as they leave the window,
    # poisoning NaN into every freed block: any read of one would reach the tokens
    from simkv.engine.kv.groups import HybridKVCacheManager
    from simkv.gpu.engine import Engine, requests_from_frame, run_offline
    from simkv.gpu.model import LlamaModel
    from simkv.gpu.tokens import prompt_token_ids
    from tests.test_engine_cpu import workload

    path = write_config(tmp_path, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    frame = workload().iloc[[0, 3]].copy()           # 30 and 13 prompt tokens
    frame["output_tokens"] = 3
    frame["n"] = 1
    frame["request_id"] = range(2)
    scn = moe_scenario(path, enable_prefix_caching=True)
    assert isinstance(Engine(scn, "cpu", dtype=torch.float32, attention="triton").scheduler.kv,
                      HybridKVCacheManager)
    run = run_offline(scn, frame, device=DEVICE, dtype=torch.float32, attention="triton", poison=True)
    model = LlamaModel(scn.model, DEVICE, torch.float32, seed=0)
    assert model.layer_windows == [8, None]
    for req in requests_from_frame(frame):
        prompt = prompt_token_ids(req, scn.model.vocab_size, seed=0)
        assert run.tokens[(req.request_id, 0)] == plain_greedy(model, prompt, 3), req.request_id
    sliding, full = sorted(run.result.summary["kv_groups"], key=lambda g: g["attention_type"] != "sliding")
    assert sliding["blocks_used_peak"] < full["blocks_used_peak"]


@needs_kernels
def test_the_moe_engine_generates_the_plain_models_greedy_tokens(tmp_path):
    from simkv.gpu.engine import requests_from_frame, run_offline
    from simkv.gpu.model import LlamaModel
    from simkv.gpu.tokens import prompt_token_ids
    from tests.test_engine_cpu import workload

    frame = workload().iloc[[0, 3, 6]].copy()     # 30, 13, 9 prompt tokens; the first chunked
    frame["output_tokens"] = 3
    frame["n"] = 1
    frame["request_id"] = range(3)
    raw = {"name": "moe-cpu", "model": str(write_config(tmp_path)), "gpu": "h200", "seed": 0,
           "cache": {"block_size": 4, "num_gpu_blocks_override": 128, "enable_prefix_caching": False},
           "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 48},
           "workload": {"synthetic": {"num_requests": 1, "output_tokens": 1,
                                      "prompt_tokens": {"dist": "fixed", "value": 8}}}}
    scn = simkv.load_scenario(raw)
    run = run_offline(scn, frame, device=DEVICE, dtype=torch.float32, attention="triton", poison=True)
    model = LlamaModel(scn.model, DEVICE, torch.float32, seed=0)   # the engine's weights
    for req in requests_from_frame(frame):
        prompt = prompt_token_ids(req, scn.model.vocab_size, seed=0)
        assert run.tokens[(req.request_id, 0)] == plain_greedy(model, prompt, 3), req.request_id
