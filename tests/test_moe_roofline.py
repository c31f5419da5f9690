"""Mixture-of-experts step cost: the expected distinct experts a step's tokens touch (closed form
and skewed), checked against enumeration and hand arithmetic, and the roofline's expert term."""
import itertools
from fractions import Fraction

import pytest

from simkv.costmodel.features import (expected_experts_touched, expert_inclusion_probabilities,
                                      moe_step)
from simkv.costmodel.roofline import RooflineCostModel, RooflineParams
from simkv.engine.plan import StepPlan
from simkv.specs import load_gpu, load_model


def decode_plan(batch: int, context: int = 1000) -> StepPlan:
    """A decode-only step of `batch` sequences of `context` tokens each."""
    return StepPlan(step=0, now_s=0.0, scheduled=[None] * batch, num_decode_tokens=batch,
                    decode_context_tokens=batch * context)


def enumerated_touched(num_experts: int, top_k: int, num_tokens: int) -> Fraction:
    """Mean distinct experts over every way `num_tokens` tokens can each pick `top_k`."""
    choices = list(itertools.combinations(range(num_experts), top_k))
    total = sum(len(set().union(*picks))
                for picks in itertools.product(choices, repeat=num_tokens))
    return Fraction(total, len(choices) ** num_tokens)


@pytest.mark.parametrize("num_experts,top_k,num_tokens", [(4, 2, 2), (5, 2, 3), (6, 1, 4),
                                                           (6, 3, 2), (8, 2, 1)])
def test_uniform_closed_form_equals_enumerating_every_routing(num_experts, top_k, num_tokens):
    assert expected_experts_touched(num_experts, top_k, num_tokens) == pytest.approx(
        float(enumerated_touched(num_experts, top_k, num_tokens)), rel=1e-12)


def test_uniform_figures_by_hand():
    assert expected_experts_touched(8, 2, 2) == pytest.approx(8 * (1 - (6 / 8) ** 2))   # 3.5
    assert expected_experts_touched(128, 8, 1) == pytest.approx(8)
    # Qwen3-30B-A3B: a batch of 64 touches nearly all 128 experts
    assert expected_experts_touched(128, 8, 64) == pytest.approx(128 * (1 - (120 / 128) ** 64))
    assert 125 < expected_experts_touched(128, 8, 64) < 126
    assert expected_experts_touched(128, 8, 0) == 0.0


def test_skewed_routing_one_pick_of_three_by_hand():
    # popularity 1, 1/2, 1/3 -> p = 6/11, 3/11, 2/11; two tokens touch 1 expert when they pick
    # the same one (probability sum p^2 = 49/121), else 2: 2 - 49/121 = 193/121
    assert expert_inclusion_probabilities(3, 1, 1.0) == pytest.approx([6 / 11, 3 / 11, 2 / 11])
    assert expected_experts_touched(3, 1, 2, skew=1.0) == pytest.approx(193 / 121)


@pytest.mark.parametrize("skew", [0.0, 0.5, 1.0, 3.0, 20.0])
def test_inclusion_probabilities_sum_to_top_k_and_stay_probabilities(skew):
    q = expert_inclusion_probabilities(16, 4, skew)
    assert sum(q) == pytest.approx(4) and all(0 <= x <= 1 for x in q)
    assert q == sorted(q, reverse=True)
    assert expected_experts_touched(16, 4, 1, skew) == pytest.approx(4)   # one token: k


def test_strong_skew_caps_the_most_popular_experts_at_certainty():
    q = expert_inclusion_probabilities(4, 2, 20.0)
    assert q[0] == 1.0 and q[1] == pytest.approx(1.0, abs=1e-3)
    assert expected_experts_touched(4, 2, 1000, 20.0) < expected_experts_touched(4, 2, 1000)


def test_skew_touches_fewer_experts_than_uniform_routing():
    for tokens in (2, 8, 64):
        touched = [expected_experts_touched(128, 8, tokens, s) for s in (0.0, 0.5, 1.0)]
        assert touched[0] > touched[1] > touched[2]


# ---------------------------------------------------------------------------------------------
# the roofline's expert term


@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_roofline_reads_the_touched_experts_of_every_moe_layer(batch):
    model, gpu = load_model("qwen3-30b-a3b"), load_gpu("h200")
    p = RooflineParams()
    roofline = RooflineCostModel(model, gpu, params=p)
    terms = roofline.cost(decode_plan(batch)).terms
    expert_bytes = 2 * 3 * 2048 * 768                                 # bf16, one expert
    touched = 128 * (1 - (1 - 8 / 128) ** batch)
    read_s = touched * 48 * expert_bytes / (gpu.hbm_bandwidth_bytes_per_s * p.bandwidth_efficiency)
    flop_s = batch * 8 * 2 * (3 * 2048 * 768) * 48 / (gpu.bf16_flops_per_s * p.flops_efficiency)
    assert terms["experts"] == pytest.approx(max(read_s, flop_s), rel=1e-12)
    # the rest of the weights (attention, routers, embeddings, LM head) are read every step
    rest = model.weight_bytes() - 128 * 48 * expert_bytes
    rest_flops = 2 * batch * (48 * (18_874_624 + 128 * 2048 + 2 * 2048) + 2048) \
        + 2 * batch * 151936 * 2048                          # every row samples: the LM head
    assert terms["linear"] == pytest.approx(max(
        rest / (gpu.hbm_bandwidth_bytes_per_s * p.bandwidth_efficiency),
        rest_flops / (gpu.bf16_flops_per_s * p.flops_efficiency)), rel=1e-12)


def test_a_batch_of_one_reads_top_k_experts_and_256_reads_them_all():
    model = load_model("qwen3-30b-a3b")
    one, full = moe_step(decode_plan(1), model), moe_step(decode_plan(256), model)
    all_experts = model.routed_expert_bytes()
    assert one.expert_bytes_read == pytest.approx(all_experts * 8 / 128)     # 1/16
    assert full.expert_bytes_read == pytest.approx(all_experts, rel=1e-6)
    # a dense model of the active size reads 8 experts' worth whatever the batch; a batch of 8
    # touches 51.6 of the 128
    eight = moe_step(decode_plan(8), model)
    assert one.active_expert_bytes == eight.active_expert_bytes == one.expert_bytes_read
    assert eight.experts_touched == pytest.approx(128 * (1 - (120 / 128) ** 8))
    assert eight.expert_bytes_read == pytest.approx(all_experts * eight.experts_touched / 128)


def test_expert_skew_lowers_the_expert_term_of_a_mid_sized_batch():
    model, gpu = load_model("qwen3-30b-a3b"), load_gpu("h200")
    uniform = RooflineCostModel(model, gpu).cost(decode_plan(16)).terms["experts"]
    skewed = RooflineCostModel(model, gpu, params=RooflineParams(expert_skew=1.0)) \
        .cost(decode_plan(16)).terms["experts"]
    assert skewed < uniform


def test_a_dense_model_keeps_its_terms_and_reads_every_weight():
    model, gpu = load_model("llama-3.1-8b"), load_gpu("h200")
    roofline = RooflineCostModel(model, gpu)
    assert "experts" not in roofline.term_names
    p = roofline.params
    linear = roofline.cost(decode_plan(1)).terms["linear"]
    assert linear == pytest.approx(2 * 8_030_261_248
                                   / (gpu.hbm_bandwidth_bytes_per_s * p.bandwidth_efficiency))


def test_fp8_weights_read_half_the_bytes_and_run_at_the_fp8_rate():
    gpu = load_gpu("h200")
    bf16 = RooflineCostModel(load_model("llama-3.1-70b"), gpu)
    fp8 = RooflineCostModel(load_model("llama-3.1-70b", weights_dtype="fp8"), gpu)
    assert 0.50 < fp8.weight_bytes / bf16.weight_bytes < 0.52
    assert fp8.seconds_per_flop == pytest.approx(
        bf16.seconds_per_flop * gpu.bf16_flops_per_s / gpu.fp8_flops_per_s)


def test_mxfp4_experts_read_their_quantized_bytes():
    model, gpu = load_model("gpt-oss-20b"), load_gpu("h200")
    moe = moe_step(decode_plan(1), model)
    per_expert = (5760 * 2880 // 2 + 5760 * 90) + (2880 * 2880 // 2 + 2880 * 90) \
        + 2 * (5760 + 2880)                                   # MXFP4 blocks, bf16 biases
    assert moe.expert_bytes_read == pytest.approx(4 * 24 * per_expert)


def scenario(**cost_model):
    from simkv.config.scenario import load_scenario
    return load_scenario({
        "model": "qwen3-30b-a3b", "cost_model": {"source": "roofline", **cost_model},
        "workload": {"synthetic": {"num_requests": 4, "arrival": {"process": "poisson", "rate": 1},
                                   "prompt_tokens": {"dist": "fixed", "value": 10},
                                   "output_tokens": {"dist": "fixed", "value": 4}}}})


def test_the_scenario_sets_the_rooflines_expert_skew():
    from simkv.costmodel import load_cost_model
    assert load_cost_model(scenario(expert_skew=0.5)).params.expert_skew == 0.5
    assert load_cost_model(scenario()).params.expert_skew == 0.0


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf")])
def test_a_negative_or_non_finite_expert_skew_is_refused(bad):
    from simkv.errors import InputError
    with pytest.raises(InputError, match=r"cost_model.expert_skew: .*\(expected a number in \[0, 10\]\)"):
        scenario(expert_skew=bad)
