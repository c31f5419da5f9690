"""Mixture-of-experts and quantized model specs: parameters and checkpoint bytes, counted by hand
from each bundled config's numbers and held against the figures the model cards publish."""
import json

import pytest

from simkv.errors import InputError
from simkv.sizing import estimate_activation_bytes, estimate_moe_workspace_bytes
from simkv.specs import load_model, profiles_dir
from tests.test_specs import write_config


def config(name: str) -> dict:
    return json.loads((profiles_dir() / "models" / f"{name}.json").read_text())


def write_model(tmp_path, name: str, **changes):
    """A copy of bundled `name`'s config.json with `changes` (None deletes)."""
    c = config(name)
    for key, value in changes.items():
        if value is None:
            c.pop(key, None)
        else:
            c[key] = value
    folder = tmp_path / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(c))
    return str(folder / "config.json")


# ---------------------------------------------------------------------------------------------
# parameters


def test_mixtral_8x7b_counts_by_hand_and_matches_its_published_total():
    m = load_model("mixtral-8x7b-v0.1")
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024          # q, o; k, v (8 kv heads x 128)
    expert = 3 * 4096 * 14336                              # w1, w3, w2
    router = 8 * 4096
    per_layer = attention + 8 * expert + router + 2 * 4096
    total = 32 * per_layer + 2 * 32000 * 4096 + 4096
    assert m.num_params == total == 46_702_792_704
    assert m.active_params == total - 32 * 6 * expert       # 2 of 8 experts per token
    assert round(m.active_params / 1e9, 1) == 12.9          # "12.9B active" (Mistral AI)
    assert (m.experts.num_experts, m.experts.top_k, m.experts.num_moe_layers) == (8, 2, 32)


def test_qwen3_30b_a3b_counts_by_hand_and_matches_its_card():
    m = load_model("qwen3-30b-a3b")
    attention = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128   # q, k, v, o, q/k norms
    expert = 3 * 2048 * 768
    per_layer = attention + 128 * expert + 128 * 2048 + 2 * 2048
    total = 48 * per_layer + 2 * 151936 * 2048 + 2048
    assert m.num_params == total
    assert m.active_params == total - 48 * 120 * expert
    # model card: 30.5B in total, 3.3B activated (3.35B, the card truncates)
    assert round(m.num_params / 1e9, 1) == 30.5 and int(m.active_params / 1e8) == 33
    assert m.expert_params == expert and m.experts.expert_intermediate_size == 768


def test_gpt_oss_20b_counts_biases_and_sinks_and_matches_the_model_card_table():
    m = load_model("gpt-oss-20b")
    attention = (2880 * 4096 + 4096) + 2 * (2880 * 512 + 512) + (4096 * 2880 + 2880) + 64
    expert = 2880 * 5760 + 5760 + 2880 * 2880 + 2880       # gate_up (+bias), down (+bias)
    router = 2880 * 32 + 32
    per_layer = attention + 32 * expert + router + 2 * 2880
    embedding = 201088 * 2880
    total = 24 * per_layer + 2 * embedding + 2880
    assert m.num_params == total
    parts = m.params_by_part()
    # gpt-oss model card, table 1: MLP 19.12B, attention 0.64B, 20.91B in all, 3.61B active
    # (its active count leaves out the embedding table; simkv's keeps it)
    assert round((parts["expert"] + parts["router"]) / 1e9, 2) == 19.12
    assert round(24 * attention / 1e9, 2) == 0.64
    assert round(total / 1e9, 2) == 20.91
    assert m.active_params == total - 24 * 28 * expert
    assert round((m.active_params - embedding) / 1e9, 2) == 3.61


def test_deepseek_v3_counts_mla_shared_experts_and_first_dense_layers_by_hand():
    m = load_model("deepseek-v3")
    mla = (1536 * 7168 + 1536 + 128 * 192 * 1536          # q_a, its norm, q_b
           + 576 * 7168 + 512 + 128 * 256 * 512           # kv_a (latent + rope), norm, kv_b
           + 7168 * 128 * 128)                            # o
    dense_mlp = 3 * 7168 * 18432
    expert = 3 * 7168 * 2048
    moe = 256 * expert + expert + 256 * 7168 + 256        # routed, 1 shared, gate + its bias
    total = 3 * (mla + dense_mlp + 2 * 7168) + 58 * (mla + moe + 2 * 7168) \
        + 2 * 129280 * 7168 + 7168
    assert m.num_params == total
    assert round(total / 1e9) == 671                      # "671B total parameters"
    assert m.experts.num_moe_layers == 58 and m.experts.moe_layers[0] == 3
    assert m.active_params == total - 58 * 248 * expert
    # "36.6B activated (including the 0.9B output head)": all but the embedding table
    assert round((m.active_params - 129280 * 7168) / 1e9, 1) == 36.6


def test_a_dense_model_has_every_parameter_active():
    m = load_model("llama-3.1-8b")
    assert m.experts is None and m.active_params == m.num_params and m.expert_bytes == 0


def test_forward_flops_count_the_active_parameters_only():
    m = load_model("qwen3-30b-a3b")
    per_token, per_sample, per_pair = m.forward_flops()
    assert per_token == 2.0 * (m.active_params - 2 * 151936 * 2048)
    assert per_pair == 4.0 * 48 * 32 * 128
    d = load_model("deepseek-v3")
    assert d.forward_flops()[2] == 2.0 * 61 * 128 * (192 + 128)   # MLA: qk 128 + 64, v 128


# ---------------------------------------------------------------------------------------------
# KV


def test_mla_caches_one_latent_per_token_and_layer():
    assert load_model("deepseek-v3").kv_bytes_per_token("bf16") == 61 * (512 + 64) * 2 == 70_272


def test_gpt_oss_kv_per_token_sums_its_24_attention_layers():
    # a token held by every layer (the pool's groups: tests/test_sizing_groups.py)
    assert load_model("gpt-oss-20b").kv_bytes_per_token("bf16") == 2 * 24 * 8 * 64 * 2


# ---------------------------------------------------------------------------------------------
# checkpoint bytes


def test_mxfp4_experts_hold_four_bits_and_a_scale_byte_per_32_rest_bf16():
    m = load_model("gpt-oss-20b")
    gate_up = 5760 * 2880 // 2 + 5760 * (2880 // 32)      # per expert and layer
    down = 2880 * 2880 // 2 + 2880 * (2880 // 32)
    quantized_params = 24 * 32 * (5760 * 2880 + 2880 * 2880)
    expected = 24 * 32 * (gate_up + down) + 2 * (m.num_params - quantized_params)
    assert m.weight_bytes() == expected
    assert round(m.weight_bytes() / 1e9, 1) == 13.8       # the checkpoint's safetensors, 13.8 GB
    assert m.expert_bytes == gate_up + down + 2 * (5760 + 2880)   # biases stay bf16


def test_fp8_blocks_carry_one_float32_scale_per_128x128():
    m = load_model("deepseek-v3")
    blocks = lambda rows, cols: -(-rows // 128) * -(-cols // 128)   # noqa: E731
    mla = [(1536, 7168), (24576, 1536), (576, 7168), (32768, 512), (7168, 16384)]
    dense = [(18432, 7168), (18432, 7168), (7168, 18432)]
    expert = [(2048, 7168), (2048, 7168), (7168, 2048)]
    matrices = [(s, 61) for s in mla] + [(s, 3) for s in dense] + [(s, 58 * 257) for s in expert]
    fp8 = sum(n * (r * c + 4 * blocks(r, c)) for (r, c), n in matrices)
    quantized_params = sum(n * r * c for (r, c), n in matrices)
    assert blocks(576, 7168) == 5 * 56                    # 576 rows: a partial block
    assert m.weight_bytes() == fp8 + 2 * (m.num_params - quantized_params)
    assert m.weights_dtype == "fp8"


def test_fp8_llama_3_1_70b_is_about_half_its_bf16_weights():
    bf16 = load_model("llama-3.1-70b")
    fp8 = load_model("llama-3.1-70b", weights_dtype="fp8")
    unquantized = 2 * 128256 * 8192 + 80 * 2 * 8192 + 8192      # embeddings, LM head, norms
    per_tensor_scales = 4 * 7 * 80                              # q k v o gate up down
    assert fp8.weight_bytes() == (bf16.num_params - unquantized) + per_tensor_scales \
        + 2 * unquantized
    assert bf16.weight_bytes() == 2 * 70_553_706_496
    assert 0.50 < fp8.weight_bytes() / bf16.weight_bytes() < 0.52


def test_int4_weights_carry_a_scale_and_a_zero_point_per_group_of_128():
    m = load_model("llama-3.1-8b", weights_dtype="int4")
    shapes = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096),
              (14336, 4096), (14336, 4096), (4096, 14336)]
    per_layer = sum(r * c // 2 + r * (c // 128) * (2 + 0.5) for r, c in shapes)
    quantized = 32 * sum(r * c for r, c in shapes)
    assert m.weight_bytes() == 32 * per_layer + 2 * (m.num_params - quantized)
    assert m.weights_dtype == "int4"


def test_gptq_config_adds_packed_zeros_and_a_group_index(tmp_path):
    path = write_config(tmp_path / "gptq", quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False})
    m = load_model(path)
    shapes = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096),
              (14336, 4096), (14336, 4096), (4096, 14336)]
    per_layer = sum(r * c // 2 + r * (c // 128) * (0.5 + 2) + 4 * c for r, c in shapes)
    quantized = 32 * sum(r * c for r, c in shapes)
    assert m.weight_bytes() == 32 * per_layer + 2 * (m.num_params - quantized)


def test_awq_modules_to_not_convert_stay_bf16(tmp_path):
    path = write_config(tmp_path / "awq", quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
        "modules_to_not_convert": ["self_attn"]})
    m = load_model(path)
    mlp = [(14336, 4096), (14336, 4096), (4096, 14336)]
    per_layer = sum(r * c // 2 + r * (c // 128) * 2.5 for r, c in mlp)
    assert m.weight_bytes() == 32 * per_layer + 2 * (m.num_params - 32 * sum(r * c for r, c in mlp))


def test_weights_dtype_bf16_serves_a_quantized_checkpoint_unquantized():
    m = load_model("gpt-oss-20b", weights_dtype="bf16")
    assert m.weight_bytes() == 2 * m.num_params and m.quantization is None


@pytest.mark.parametrize("method", ["compressed-tensors", "bitsandbytes", None])
def test_an_unsupported_quantization_method_is_one_error_naming_it(tmp_path, method):
    path = write_config(tmp_path / "q", quantization_config={"quant_method": method})
    with pytest.raises(InputError) as e:
        load_model(path)
    assert f"unsupported quantization method {method!r}" in str(e.value)
    assert "fp8, awq, gptq, mxfp4" in str(e.value) and "q/config.json" in str(e.value)


def test_mxfp4_on_a_dense_model_is_refused():
    with pytest.raises(InputError, match="routed experts only"):
        load_model("llama-3.1-8b", weights_dtype="mxfp4")


# ---------------------------------------------------------------------------------------------
# activation workspace


def test_moe_workspace_holds_the_fused_expert_buffers_and_router_outputs():
    m = load_model("qwen3-30b-a3b")
    tokens = 8192
    experts = tokens * 8 * (max(2 * 768, 2048) + 768) * 2     # gate/up|down buffer + activation
    router = tokens * (128 * 2 + 8 * (4 + 4))                  # logits, top-k weights and ids
    assert estimate_moe_workspace_bytes(m, tokens) == experts + router
    # beyond a chunk of 16,384 tokens the expert buffers stop growing, the router's do not
    big = 4 * 16384
    assert estimate_moe_workspace_bytes(m, big) == 16384 * 8 * 2816 * 2 + big * (256 + 64)


def test_the_moe_layer_sets_the_activation_peak_when_it_is_the_largest(tmp_path):
    from types import SimpleNamespace
    m = load_model("mixtral-8x7b-v0.1")
    scheduler = SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=256)
    hidden = 8192 * 4 * 4096 * 2
    moe = 8192 * 2 * (2 * 14336 + 14336) * 2 + 8192 * (8 * 2 + 2 * 8)
    assert estimate_activation_bytes(m, scheduler) == hidden + moe


def test_a_weights_dtype_override_is_another_checkpoint_with_its_own_name():
    # so that the profile and measured ledger of the stored bf16 weights are not taken for it
    assert load_model("llama-3.1-8b", weights_dtype="fp8").name == "llama-3.1-8b-fp8"
    assert load_model("llama-3.1-8b", weights_dtype="bf16").name == "llama-3.1-8b"
    assert load_model("gpt-oss-20b", weights_dtype="mxfp4").name == "gpt-oss-20b"
