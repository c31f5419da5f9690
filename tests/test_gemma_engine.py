"""The sample model's Gemma 3 layers on CPU.

The engine serving `tests/data/tiny-gemma3.json` (3 layers: two sliding ones with a 16-token
window and their own RoPE base, one full; query_pre_attn_scalar 24, head_dim 16; block size 4)
must generate, greedily and in float32, the tokens of a plain torch Gemma 3 written out below
(transformers' modeling_gemma3 order, whole-sequence recompute, no pages), over prompts longer
than the window, with the torch reference attention and with the Triton kernels (under
TRITON_INTERPRET=1 on CPU). The same plain model with one Gemma-specific piece left out gives
other tokens, so each piece is one the comparison checks. The engine's fixed-shape steps (a slot
mapping and block tables per KV cache group, as CUDA graphs replay them) give the eager steps'
tokens, and the plain model's, with prefix hits and with preemptions.
"""
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

import simkv  # noqa: E402
from simkv.gpu.kernels import INTERPRET  # noqa: E402
from simkv.specs import load_model  # noqa: E402

TINY_GEMMA = Path(__file__).parent / "data" / "tiny-gemma3.json"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
needs_kernels = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                   reason="Triton kernels need a GPU or TRITON_INTERPRET=1")
# the pieces of Gemma 3 the plain model can leave out, one at a time
PIECES = ("embedding_scale", "post_norms", "query_pre_attn_scalar", "local_rope", "gelu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def plain_logits(model, token_ids: list, without: str = "") -> torch.Tensor:
    """Logits [positions, vocab] of `token_ids` from the model's weights with no cache: Gemma
    3's decoder layer (transformers' Gemma3DecoderLayer), `without` one of PIECES."""
    spec, f32 = model.spec, torch.float32

    def w(t):
        return t.detach().to("cpu", f32)
    H, KH, D, n = spec.num_heads, spec.num_kv_heads, spec.head_dim, len(token_ids)
    eps = float(spec.rms_norm_eps)

    def rms(x, weight):       # the weight is Gemma's (1 + w): the model stores it so
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight

    def rope(x, base, factor):
        inv = 1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float64) / D) / factor
        ang = (torch.arange(n)[:, None].double() * inv[None]).to(f32)[:, None, :]
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)

    def post(x, weight):
        return x if without == "post_norms" else rms(x, weight)

    x = w(model.embed)[torch.tensor(token_ids)]
    if without != "embedding_scale":
        x = x * torch.tensor(spec.hidden_size ** 0.5, dtype=torch.bfloat16).float() \
            if model.dtype == torch.bfloat16 else x * spec.hidden_size ** 0.5
    scale = (D if without == "query_pre_attn_scalar" else spec.query_pre_attn_scalar) ** -0.5
    for layer, window in zip(model.layers, model.layer_windows):
        h = rms(x, w(layer.input_norm))
        qkv = h @ w(layer.qkv).T
        q = rms(qkv[:, :H * D].view(n, H, D), w(layer.q_norm))
        k = rms(qkv[:, H * D:(H + KH) * D].view(n, KH, D), w(layer.k_norm))
        v = qkv[:, (H + KH) * D:].view(n, KH, D)
        if window is not None and without != "local_rope":
            base, factor = spec.rope_local_base_freq, 1.0
        else:
            base, factor = spec.rope_theta, float(spec.rope_scaling["factor"])
        q, k = rope(q, base, factor), rope(k, base, factor)
        attn = torch.empty(n, H, D)
        hidden_keys = torch.ones(n, n, dtype=torch.bool).triu(1)
        if window is not None:
            hidden_keys |= torch.ones(n, n, dtype=torch.bool).tril(-window)
        for head in range(H):
            kv = head // (H // KH)
            scores = (q[:, head] @ k[:, kv].T * scale).masked_fill(hidden_keys, float("-inf"))
            attn[:, head] = torch.softmax(scores, -1) @ v[:, kv]
        x = x + post(attn.reshape(n, H * D) @ w(layer.o).T, w(layer.attn_out_norm))
        h = rms(x, w(layer.post_norm))                       # pre_feedforward_layernorm
        gate, up = (h @ w(layer.gate_up).T).chunk(2, dim=-1)
        act = F.silu(gate) if without == "gelu" else F.gelu(gate, approximate="tanh")
        x = x + post((act * up) @ w(layer.down).T, w(layer.mlp_out_norm))
    return rms(x, w(model.final_norm)) @ w(model.embed).T     # tied, no soft-capping


def plain_greedy(model, prompt: list, num_tokens: int, without: str = "") -> list:
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(int(plain_logits(model, tokens, without)[-1].argmax()))
    return tokens[len(prompt):]


def gemma_scenario(**cache):
    return simkv.load_scenario({
        "name": "gemma-cpu", "model": str(TINY_GEMMA), "gpu": "h200", "seed": 0,
        "cache": {"block_size": 4, "num_gpu_blocks_override": 128, "enable_prefix_caching": True,
                  **cache},
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64},
        "workload": {"synthetic": {"num_requests": 1, "output_tokens": 1,
                                   "prompt_tokens": {"dist": "fixed", "value": 8}}}})


def test_the_gemma_spec_carries_its_own_fields_and_the_27b_defaults():
    tiny, big = load_model(str(TINY_GEMMA)), load_model("gemma-3-27b")
    assert (tiny.query_pre_attn_scalar, tiny.rope_local_base_freq, tiny.hidden_activation) \
        == (24.0, 100.0, "gelu_pytorch_tanh")
    assert (big.query_pre_attn_scalar, big.rope_local_base_freq, big.rope_theta) \
        == (168.0, 10_000.0, 1_000_000.0)
    assert big.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert load_model("llama-3.1-8b").query_pre_attn_scalar is None


def test_the_gemma_model_holds_the_weight_bytes_simkv_size_counts(monkeypatch):
    # the vision tower included (allocated, never computed); the 27B's tensors on the meta
    # device, drawn as empty (a generator cannot draw there)
    from simkv.gpu.model import LlamaModel
    tiny = load_model(str(TINY_GEMMA))
    model = LlamaModel(tiny, "cpu", torch.bfloat16)
    assert model.vision is not None and model.vision.numel() == tiny.params_by_part()["vision"]
    assert model.weight_bytes == tiny.weight_bytes()
    monkeypatch.setattr(LlamaModel, "_randn", lambda self, seed, name, shape, std: torch.empty(
        shape, device=self.device, dtype=self.dtype))
    big = load_model("gemma-3-27b")
    assert LlamaModel(big, "meta", torch.bfloat16).weight_bytes == big.weight_bytes() \
        == 54_864_813_280


def test_the_gemma_layers_take_their_windows_rope_and_scale():
    from simkv.gpu.model import LlamaModel, rope_inv_freq
    spec = load_model(str(TINY_GEMMA))
    model = LlamaModel(spec, "cpu", torch.float32)
    assert model.layer_windows == [16, 16, None]
    assert model.attn_scale == pytest.approx(24 ** -0.5)
    local = 1.0 / 100.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    torch.testing.assert_close(rope_inv_freq(spec, local=True), local)
    torch.testing.assert_close(rope_inv_freq(spec), 1.0 / 10_000.0 ** (
        torch.arange(0, 16, 2, dtype=torch.float64) / 16) / 2.0)
    assert model.layer_inv_freq[0] is model.layer_inv_freq[1] is not model.inv_freq
    assert model.layer_inv_freq[2] is model.inv_freq


@needs_kernels
def test_the_gelu_and_mul_kernel_computes_gelus_tanh_form():
    from simkv.gpu.model import LlamaModel
    model = LlamaModel(load_model(str(TINY_GEMMA)), DEVICE, torch.float32, attention="triton")
    gu = torch.randn(5, 2 * 40, generator=torch.Generator().manual_seed(0)).mul_(3).to(DEVICE)
    expected = F.gelu(gu[:, :40], approximate="tanh") * gu[:, 40:]
    torch.testing.assert_close(model._act_and_mul(gu), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["reference", pytest.param("triton", marks=needs_kernels)])
def test_the_gemma_engine_generates_the_plain_gemma_models_greedy_tokens(attention):
    # prompts of 30 and 21 tokens against a 16-token window, the first chunked (32 per step);
    # poisoning NaN into freed blocks: a read of a window block the manager freed would show
    from simkv.engine.kv.groups import HybridKVCacheManager
    from simkv.gpu.engine import Engine, requests_from_frame, run_offline
    from simkv.gpu.model import LlamaModel
    from simkv.gpu.tokens import prompt_token_ids
    from tests.test_engine_cpu import workload

    frame = workload().iloc[[0, 2]].copy()
    frame["output_tokens"] = 4
    frame["n"] = 1
    frame["request_id"] = range(2)
    scn = gemma_scenario()
    device = DEVICE if attention == "triton" else "cpu"
    assert isinstance(Engine(scn, "cpu", dtype=torch.float32, attention=attention).scheduler.kv,
                      HybridKVCacheManager)
    run = run_offline(scn, frame, device=device, dtype=torch.float32, attention=attention,
                      poison=True)
    model = LlamaModel(scn.model, "cpu", torch.float32, seed=0)    # the engine's weights
    for req in requests_from_frame(frame):
        prompt = prompt_token_ids(req, scn.model.vocab_size, seed=0)
        tokens = run.tokens[(req.request_id, 0)]
        assert tokens == plain_greedy(model, prompt, 4), (req.request_id, attention)
    groups = run.result.summary["kv_groups"]        # a group per layer here: 1 layer slot each
    assert [g["attention_type"] for g in groups] == ["sliding", "sliding", "full"]
    assert all(g["blocks_used_peak"] < groups[2]["blocks_used_peak"] for g in groups[:2])


@pytest.mark.parametrize("attention", ["reference", pytest.param("triton", marks=needs_kernels)])
def test_a_paged_prefill_past_the_window_has_the_plain_models_logits_and_each_piece_counts(
        attention):
    # one 30-token prompt in one prefill over shuffled blocks of 4: every position's logits
    # against the plain model's; with any Gemma piece left out they move far more than that
    from simkv.gpu.attention import AttentionMetadata
    from simkv.gpu.model import LlamaModel
    device = DEVICE if attention == "triton" else "cpu"
    model = LlamaModel(load_model(str(TINY_GEMMA)), device, torch.float32, attention=attention)
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    blocks = [5, 2, 7, 0, 3, 6, 1, 4]
    table = torch.tensor(blocks, dtype=torch.int32, device=device)[None]
    pos = torch.arange(30, device=device)
    meta = AttentionMetadata(
        slot_mapping=(table[0].long()[pos // 4] * 4 + pos % 4), num_prefill_tokens=30,
        prefill_block_tables=table,
        prefill_query_start_loc=torch.tensor([0, 30], dtype=torch.int32, device=device),
        prefill_seq_lens=torch.tensor([30], dtype=torch.int32, device=device))
    with torch.inference_mode():
        logits = model.forward(torch.tensor(ids, device=device), pos, meta,
                               model.allocate_kv_cache(8, 4)).cpu()
    plain = plain_logits(model, ids)
    gap = (logits - plain).abs().max().item()
    assert gap < 1e-3, gap
    for piece in PIECES:
        moved = (plain_logits(model, ids, without=piece) - plain).abs().max().item()
        assert moved > 100 * max(gap, 1e-4), (piece, moved)


def graphed_gemma_executor(scn, attention):
    """The engine's executor for `scn` (its KV cache groups) with every decode and mixed step run
    as a stand-in graph over the fixed-shape buffers."""
    from simkv.gpu.engine import engine_kv_groups
    from simkv.sizing import size_scenario
    from tests.test_engine_cpu import graphed_cpu_executor
    return graphed_cpu_executor(scn, dtype=torch.float32, attention=attention,
                                kv_groups=engine_kv_groups(size_scenario(scn)))


@pytest.mark.parametrize("blocks", [128, 44])
def test_graphed_kv_group_steps_give_the_eager_engines_and_the_plain_models_tokens(blocks):
    # 12 requests of 9-35 prompt tokens against a 16-token window, 32 tokens a step, families
    # sharing prefixes (prefix caching on); 44 blocks: the pool of one max_model_len request
    # (42 over the three groups) and two more, so requests are preempted and recomputed
    from simkv.gpu.engine import requests_from_frame, run_offline
    from simkv.gpu.tokens import prompt_token_ids
    from tests.test_engine_cpu import workload
    frame = workload()
    frame["n"] = 1
    scn = gemma_scenario(num_gpu_blocks_override=blocks)
    eager = run_offline(scn, frame, dtype=torch.float32, attention="reference", poison=True)
    executor = graphed_gemma_executor(scn, "reference")
    graphed = run_offline(scn, frame, executor=executor, poison=True)
    assert executor.num_graph_steps > 0 and executor.num_mixed_graph_steps > 0
    assert executor.num_eager_steps == 0
    assert graphed.step_tokens == eager.step_tokens
    assert graphed.tokens == eager.tokens
    summary = graphed.result.summary
    assert summary["prefix_cache_hit_ratio"] > 0
    assert (summary["preemptions"] > 0) == (blocks == 44)
    for req in requests_from_frame(frame):
        prompt = prompt_token_ids(req, scn.model.vocab_size, seed=0)
        assert graphed.tokens[(req.request_id, 0)] == plain_greedy(
            executor.model, prompt, req.output_tokens), req.request_id


@needs_kernels
def test_graphed_kv_group_steps_through_the_kernels_give_the_plain_models_tokens():
    # the Triton kernels in the fixed-shape layout: a 30-token prompt chunked past the window
    # beside a 21-token one, then decodes past the window (decode graphs of 2 rows)
    from simkv.gpu.engine import requests_from_frame, run_offline
    from simkv.gpu.model import LlamaModel
    from simkv.gpu.tokens import prompt_token_ids
    from tests.test_engine_cpu import workload
    frame = workload().iloc[[0, 2]].copy()
    frame["output_tokens"] = 6
    frame["n"] = 1
    frame["request_id"] = range(2)
    scn = gemma_scenario()
    executor = graphed_gemma_executor(scn, "triton")
    run = run_offline(scn, frame, executor=executor, poison=True)
    assert executor.num_graph_steps > 0 and executor.num_mixed_graph_steps > 0
    assert executor.num_eager_steps == 0
    model = LlamaModel(scn.model, "cpu", torch.float32, seed=0)    # the engine's weights
    for req in requests_from_frame(frame):
        prompt = prompt_token_ids(req, scn.model.vocab_size, seed=0)
        assert run.tokens[(req.request_id, 0)] == plain_greedy(model, prompt, 6), req.request_id


def test_an_engine_refuses_an_executor_without_its_kv_groups():
    from simkv.gpu.engine import Engine
    from simkv.gpu.executor import GpuExecutor
    scn = gemma_scenario()
    executor = GpuExecutor(scn.model, 128, 4, device="cpu", dtype=torch.float32,
                           attention="reference", max_num_seqs=4, max_model_len=64,
                           max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="KV cache groups"):
        Engine(scn, "cpu", executor=executor)


def test_the_profilers_engine_pass_holds_a_whole_context_gemma_request_on_the_h200():
    # the pass sizes its pool from the free memory; sized by 62 layers a block (16 x 0.5 MB),
    # half of an empty H200 held 9,167 blocks and the scenario was refused (a 131,072-token
    # request needs 11,654 over Gemma's 7 groups); a group block holds 10 layers' pages
    from simkv.gpu.engine_pass import pass_num_blocks, pass_scenario
    from simkv.sizing import size_scenario
    gemma, llama = load_model("gemma-3-27b"), load_model("llama-3.1-8b")
    free = 149 * 10 ** 9
    blocks = pass_num_blocks(gemma, free)
    assert blocks == 40_000 and blocks * 10 * 16 * 2 * 16 * 128 * 2 < free / 2
    scn = pass_scenario(gemma, 0, "profile-engine-pass", "h200", 256, blocks)
    assert size_scenario(scn).num_blocks == blocks
    # a one-group model's pool as before: half the memory over 16 tokens of every layer
    assert pass_num_blocks(llama, free) == int(0.5 * free // (16 * llama.kv_bytes_per_token()))


def test_the_profilers_pool_on_the_h200_leaves_room_for_the_ledgers_largest_forward():
    # the profiling executor's pool holds the design's longest composition; the ledger then
    # runs a 16,384-token forward into a cache of its own (8.3 GB for Gemma's 62 layers), which
    # must fit beside it, the weights and the margin for graphs and workspaces
    from simkv.gpu.profiler.run import KV_ROOM_MARGIN, LEDGER_TOKEN_COUNTS, cached_token_cap
    free = 149_500_000_000                            # an H200 with the CUDA context up
    gemma = load_model("gemma-3-27b")
    cap = cached_token_cap(gemma, torch.device("cuda"), free)
    per_token = gemma.kv_bytes_per_token("bf16")
    ledger_cache = max(LEDGER_TOKEN_COUNTS) * per_token
    assert ledger_cache > 8e9
    assert 2 * gemma.num_params + cap * per_token + ledger_cache + KV_ROOM_MARGIN <= free
    assert cap > 140_000
    for name in ("qwen3-30b-a3b", "llama-3.1-8b"):   # their caps as before: the design's bound
        assert cached_token_cap(load_model(name), torch.device("cuda"), free) == 600_000
