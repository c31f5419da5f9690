"""The roofline's attention by layer kind: window-bounded reads and pairs, linear-attention state
reads, MLA's absorbed decode (simkv.costmodel.roofline, grouped_attention)."""
from __future__ import annotations

from hypothesis import given, strategies as st
import pytest

from simkv.costmodel.roofline import RooflineCostModel, RooflineParams, window_pairs
from simkv.engine.plan import ScheduledSeq, StepPlan
from simkv.specs import load_gpu, load_model

H200 = load_gpu("h200")
P = RooflineParams()


def plan(*items) -> StepPlan:
    """A plan of (start, tokens) chunks; one token after a prompt is a decode."""
    p = StepPlan(1, 0.0, [ScheduledSeq(None, s, n, n == 1 and s > 0) for s, n in items])
    p.count_tokens()
    return p


def terms(model, p, **kw):
    return RooflineCostModel(load_model(model, **kw), H200, params=P).cost(p).terms


def seconds_per_byte():
    return 1.0 / (H200.hbm_bandwidth_bytes_per_s * P.bandwidth_efficiency)


@given(start=st.integers(0, 5000), n=st.integers(1, 3000), window=st.integers(1, 2048))
def test_window_pairs_are_the_sum_of_each_querys_window(start, n, window):
    expected = sum(min(p + 1, window) for p in range(start, start + n)) if n <= 200 else None
    got = window_pairs(start, n, window)
    if expected is not None:
        assert got == expected
    assert got <= n * window and got <= n * start + n * (n + 1) // 2


def test_gpt_oss_decode_reads_its_window_layers_up_to_128_tokens():
    # 12 full layers read 4,000 tokens, 12 window layers 128 (window - 1 + the new one); all
    # 24 write the token; 2 x 8 KV heads x 64 x 2 bytes per layer and token
    per_layer = 2 * 8 * 64 * 2
    expected = (12 * 4000 + 12 * 128 + 24) * per_layer * seconds_per_byte()
    assert terms("gpt-oss-20b", plan((3999, 1)))["kv_read_write"] == pytest.approx(expected)


def test_gemma_3_prefill_pairs_are_window_bounded_on_52_layers():
    m = load_model("gemma-3-27b")
    pair = 2.0 * m.num_heads * 2 * m.head_dim        # per layer: scores and values
    seconds_per_flop = 1.0 / (H200.bf16_flops_per_s * P.attention_flops_efficiency)
    n = 4096
    expected = (10 * n * (n + 1) // 2 + 52 * window_pairs(0, n, 1024)) * pair * seconds_per_flop
    assert terms("gemma-3-27b", plan((0, n)))["prefill_attention"] == pytest.approx(expected)


def test_linear_attention_layers_read_and_write_a_state_per_sequence_whatever_its_length():
    short = terms("qwen3-next-80b-a3b", plan((99, 1)), weights_dtype="fp8")["kv_read_write"]
    long = terms("qwen3-next-80b-a3b", plan((9999, 1)), weights_dtype="fp8")["kv_read_write"]
    per_token = 12 * 2 * 2 * 256 * 2                 # the 12 full layers' K and V
    state = 36 * 2 * 1_097_728                       # 36 layers, read and written
    assert short == pytest.approx((100 * per_token + per_token + state) * seconds_per_byte())
    assert long - short == pytest.approx(9900 * per_token * seconds_per_byte())


def test_an_mla_decode_is_the_larger_of_its_latent_read_and_its_absorbed_flops():
    # DeepSeek-V3, 128 heads: 2 x 128 x (2 x 512 + 64) FLOPs per pair and layer against a
    # 1,152-byte latent read: FLOP-bound on the H200; DeepSeek-V2-Lite's 16 heads: bytes
    for name, flop_bound in (("deepseek-v3", True), ("deepseek-v2-lite", False)):
        m = load_model(name)
        t = terms(name, plan((8191, 1)))["kv_read_write"]
        read = (8192 + 1) * m.kv_bytes_per_token() * seconds_per_byte()
        flops = 8192 * 2.0 * m.num_layers * m.num_heads * (2 * 512 + 64) \
            / (H200.bf16_flops_per_s * P.attention_flops_efficiency)
        assert t == pytest.approx(max(read, flops))
        assert (flops > read) == flop_bound


def test_a_full_attention_model_keeps_the_one_formula():
    m = load_model("llama-3.1-8b")
    expected = (4000 + 1) * m.kv_bytes_per_token() * seconds_per_byte()
    assert terms("llama-3.1-8b", plan((3999, 1)))["kv_read_write"] == pytest.approx(expected)
