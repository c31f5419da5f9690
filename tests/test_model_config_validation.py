"""Every config.json field simkv reads is type-checked where it is read: a bad value is one
`error:` line naming the file and the key, exit 2, never a traceback or a silent guess."""
import pytest

from simkv.errors import InputError
from simkv.specs import load_model
from tests.test_cli_commands import simkv as run_cli
from tests.test_moe_specs import write_model
from tests.test_specs import write_config

# (field, bad value, what the message says); on the llama-3.1-8b config
LLAMA_CASES = [
    ("num_key_value_heads", "8", "field 'num_key_value_heads' must be a positive integer, got '8'"),
    ("num_key_value_heads", 0, "field 'num_key_value_heads' must be a positive integer, got 0"),
    ("num_key_value_heads", -8, "field 'num_key_value_heads' must be a positive integer, got -8"),
    ("num_key_value_heads", 8.5, "must be a positive integer, got 8.5"),
    ("num_attention_heads", -32, "field 'num_attention_heads' must be a positive integer"),
    ("num_attention_heads", True, "field 'num_attention_heads' must be a positive integer"),
    ("head_dim", "abc", "field 'head_dim' must be a positive integer, got 'abc'"),
    ("head_dim", 127.5, "field 'head_dim' must be a positive integer, got 127.5"),
    ("head_dim", 0, "field 'head_dim' must be a positive integer, got 0"),
    ("hidden_size", 4096.5, "field 'hidden_size' must be a positive integer"),
    ("num_hidden_layers", "32", "field 'num_hidden_layers' must be a positive integer"),
    ("vocab_size", None, "missing required field 'vocab_size'"),
    ("max_position_embeddings", [131072], "field 'max_position_embeddings' must be a positive"),
    ("rope_theta", "500000", "field 'rope_theta' must be a positive number, got '500000'"),
    ("rope_theta", -1.0, "field 'rope_theta' must be a positive number"),
    ("rms_norm_eps", "1e-5", "field 'rms_norm_eps' must be a positive number, got '1e-5'"),
    ("rms_norm_eps", 0, "field 'rms_norm_eps' must be a positive number"),
    ("tie_word_embeddings", "false", "field 'tie_word_embeddings' must be true or false"),
    ("attention_bias", 1, "field 'attention_bias' must be true or false"),
    ("rope_scaling", "llama3", "field 'rope_scaling' must be an object or null"),
    ("torch_dtype", 16, "field 'torch_dtype' must be a string"),
    ("architectures", "LlamaForCausalLM", "missing required field 'architectures'"),
    ("architectures", ["BertModel"], "unsupported architecture 'BertModel'"),
    ("quantization_config", "fp8", "field 'quantization_config' must be an object"),
    ("quantization_config", {"quant_method": "hqq"}, "unsupported quantization method 'hqq'"),
    ("quantization_config", {"quant_method": "awq", "bits": 3, "group_size": 128},
     "field 'quantization_config.bits' must be 4 or 8"),
    ("quantization_config", {"quant_method": "awq", "bits": 4, "group_size": "128"},
     "field 'quantization_config.group_size' must be a positive integer or -1"),
    ("quantization_config", {"quant_method": "fp8", "weight_block_size": [128]},
     "field 'quantization_config.weight_block_size' must be two positive integers"),
]

# on the bundled MoE configs
MOE_CASES = [
    ("qwen3-30b-a3b", "num_experts", "128", "field 'num_experts' must be a positive integer"),
    ("qwen3-30b-a3b", "num_experts_per_tok", 0, "field 'num_experts_per_tok' must be a positive"),
    ("qwen3-30b-a3b", "num_experts_per_tok", 129, "'num_experts_per_tok' (129) is more than"),
    ("qwen3-30b-a3b", "moe_intermediate_size", 768.5, "field 'moe_intermediate_size' must be"),
    ("qwen3-30b-a3b", "mlp_only_layers", [48], "field 'mlp_only_layers' must be a list of layer"),
    ("qwen3-30b-a3b", "decoder_sparse_step", -1, "field 'decoder_sparse_step' must be a positive"),
    ("mixtral-8x7b-v0.1", "num_local_experts", None, "missing required field 'num_local_experts'"),
    ("deepseek-v3", "n_shared_experts", -1, "field 'n_shared_experts' must be an integer >= 0"),
    ("deepseek-v3", "first_k_dense_replace", 62, "'first_k_dense_replace' (62) is more than"),
    ("deepseek-v3", "kv_lora_rank", "512", "field 'kv_lora_rank' must be a positive integer"),
    ("gpt-oss-20b", "layer_types", ["full_attention"], "field 'layer_types' has 1 entries"),
    ("gpt-oss-20b", "sliding_window", "128", "field 'sliding_window' must be a positive integer"),
]


@pytest.mark.parametrize("key,value,message", LLAMA_CASES)
def test_a_bad_llama_field_is_refused_naming_file_and_key(tmp_path, key, value, message):
    path = write_config(tmp_path / "bad", **{key: value})
    with pytest.raises(InputError) as e:
        load_model(str(path))
    assert message in str(e.value) and "bad/config.json" in str(e.value)


@pytest.mark.parametrize("name,key,value,message", MOE_CASES)
def test_a_bad_moe_field_is_refused_naming_file_and_key(tmp_path, name, key, value, message):
    path = write_model(tmp_path, name, **{key: value})
    with pytest.raises(InputError) as e:
        load_model(path)
    assert message in str(e.value) and f"{name}/config.json" in str(e.value)


def test_an_integral_float_is_read_as_the_integer():
    # JSON writers sometimes emit 8.0; transformers reads it as 8
    import json
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        path = write_config(Path(d) / "floats", num_key_value_heads=8.0, head_dim=128.0)
        m = load_model(str(path))
        assert (m.num_kv_heads, m.head_dim) == (8, 128) and isinstance(m.head_dim, int)
        assert json.loads(Path(path).read_text())["head_dim"] == 128.0


def test_null_num_key_value_heads_is_multi_head_attention(tmp_path):
    m = load_model(str(write_config(tmp_path / "mha", num_key_value_heads=None)))
    assert m.num_kv_heads == m.num_heads == 32


def test_no_head_dim_and_hidden_not_a_multiple_of_heads_is_refused(tmp_path):
    path = write_config(tmp_path / "odd", head_dim=None, num_attention_heads=30,
                        num_key_value_heads=10)
    with pytest.raises(InputError, match=r"hidden_size \(4096\) is not a multiple of "
                                         r"num_attention_heads \(30\)"):
        load_model(str(path))


@pytest.mark.parametrize("key,value,message", [
    ("num_key_value_heads", "8", "field 'num_key_value_heads' must be a positive integer"),
    ("num_key_value_heads", -8, "field 'num_key_value_heads' must be a positive integer"),
    ("head_dim", 127.5, "field 'head_dim' must be a positive integer"),
])
def test_simkv_size_prints_one_error_line_and_exits_2(tmp_path, key, value, message):
    path = write_config(tmp_path / "cli", **{key: value})
    result = run_cli("size", "--model", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in result.stderr and "raise the budget" not in result.stderr


def test_simkv_size_refuses_an_unknown_weights_dtype():
    result = run_cli("size", "--model", "llama-3.1-8b", "--weights-dtype", "int3")
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: weights_dtype: 'int3' is not one of bf16, fp8, "
                                     "int4, mxfp4")


@pytest.mark.parametrize("key,value,message", [
    ("query_pre_attn_scalar", "168", "field 'query_pre_attn_scalar' must be a positive number"),
    ("query_pre_attn_scalar", 0, "field 'query_pre_attn_scalar' must be a positive number"),
    ("rope_local_base_freq", -1.0, "field 'rope_local_base_freq' must be a positive number"),
    ("hidden_activation", "relu", "field 'hidden_activation' must be one of gelu_pytorch_tanh, "
                                  "silu, got 'relu'"),
])
def test_a_bad_gemma_3_field_is_refused_naming_file_and_key(tmp_path, key, value, message):
    from tests.test_moe_specs import config
    c = config("gemma-3-27b")
    c["text_config"][key] = value
    path = tmp_path / "gemma" / "config.json"
    path.parent.mkdir()
    path.write_text(__import__("json").dumps(c))
    with pytest.raises(InputError) as e:
        load_model(str(path))
    assert message in str(e.value) and "gemma/config.json: text_config" in str(e.value)
