"""Model and GPU specs: bundled configs load with their published shapes and parameter counts."""
import json
import shutil
from pathlib import Path

import pytest

from simkv.specs import (
    SUPPORTED_ARCHITECTURES,
    bundled_gpus,
    bundled_models,
    load_gpu,
    load_model,
    profiles_dir,
)
from simkv.errors import InputError

MIB = 1 << 20

# Parameter counts as published on the models' cards (and by transformers' num_parameters()).
PUBLISHED_PARAMS = {
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.2-1b": 1_235_814_400,       # tied embeddings: the LM head is not counted twice
    "mistral-7b-v0.3": 7_248_023_552,
    "qwen2.5-7b": 7_615_616_512,         # includes q/k/v biases
    "qwen3-32b": 32_762_123_264,         # includes per-head q/k norms
    "llama-3.2-3b": 3_212_749_824,       # tied embeddings
}


def write_config(folder: Path, **changes) -> Path:
    """A copy of the bundled llama-3.1-8b config.json in `folder`, with `changes` (None deletes)."""
    config = json.loads((profiles_dir() / "models" / "llama-3.1-8b.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_bundled_models_are_the_fifteen_documented_ones():
    assert bundled_models() == [
        "deepseek-v2-lite", "deepseek-v3", "gemma-3-27b", "gpt-oss-20b", "llama-3.1-70b",
        "llama-3.1-8b", "llama-3.2-1b", "llama-3.2-3b", "mistral-7b-v0.3", "mixtral-8x7b-v0.1",
        "qwen2.5-7b", "qwen3-30b-a3b", "qwen3-32b", "qwen3-next-80b-a3b", "tiny",
    ]


def test_llama_3_1_8b_has_its_published_shape():
    m = load_model("llama-3.1-8b")
    assert (m.architecture, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (
        "LlamaForCausalLM", 32, 32, 8, 128)
    assert (m.hidden_size, m.intermediate_size, m.vocab_size) == (4096, 14336, 128256)
    assert m.max_position_embeddings == 131072
    assert m.rope_theta == 500000.0
    assert m.rope_scaling["rope_type"] == "llama3" and m.rope_scaling["factor"] == 8.0
    assert m.tie_word_embeddings is False
    assert m.torch_dtype == "bfloat16"


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_count_matches_the_published_figure(name):
    assert load_model(name).num_params == PUBLISHED_PARAMS[name]


def test_tiny_model_parameters_count_by_hand():
    m = load_model("tiny")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (2, 64, 4, 2, 16)
    embeddings = lm_head = 256 * 64
    attention = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64      # q, k, v (2 kv heads x 16), o
    mlp = 3 * 64 * 128
    norms = 2 * 64
    assert m.num_params == 2 * (attention + mlp + norms) + embeddings + lm_head + 64


def test_llama_3_2_1b_ties_embeddings():
    m = load_model("llama-3.2-1b")
    assert m.tie_word_embeddings is True
    assert m.head_dim == 64


def test_head_dim_defaults_to_hidden_over_heads():
    m = load_model("mistral-7b-v0.3")      # its config has no head_dim
    assert m.head_dim == 4096 // 32


def test_head_dim_from_config_wins_over_hidden_over_heads():
    m = load_model("qwen3-32b")            # 5120 / 64 would be 80
    assert m.head_dim == 128


def test_kv_bytes_per_token_is_k_and_v_over_every_layer():
    m = load_model("llama-3.1-8b")
    assert m.kv_bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2 == 131_072
    assert m.kv_bytes_per_token("fp8") == 65_536


def test_weight_bytes_are_params_times_dtype_bytes():
    m = load_model("llama-3.1-8b")
    assert m.weight_bytes() == 2 * 8_030_261_248
    assert m.weight_bytes(dtype_bytes=1) == 8_030_261_248


def test_config_json_loads_from_a_path_named_after_its_folder(tmp_path):
    path = write_config(tmp_path / "my-llama")
    assert load_model(str(path)).name == "my-llama"
    assert load_model(str(tmp_path / "my-llama")).num_layers == 32   # the folder works too


def test_missing_field_is_rejected_naming_file_and_field(tmp_path):
    path = write_config(tmp_path / "broken", num_hidden_layers=None)
    with pytest.raises(InputError, match=r"broken/config.json: missing required field 'num_hidden_layers'"):
        load_model(str(path))


def test_unsupported_architecture_is_rejected_listing_the_supported_ones(tmp_path):
    path = write_config(tmp_path / "phi", architectures=["Phi3ForCausalLM"])
    with pytest.raises(InputError) as e:
        load_model(str(path))
    assert "unsupported architecture 'Phi3ForCausalLM'" in str(e.value)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(e.value)


def test_config_that_is_not_json_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_model(str(tmp_path / "config.json"))


def test_unknown_model_name_suggests_the_closest_bundled_one():
    with pytest.raises(InputError, match="did you mean llama-3.1-8b"):
        load_model("llama-3.1-8")


def test_bundled_gpus_are_the_five_documented_ones():
    assert bundled_gpus() == ["h200", "h100", "a100-80gb", "l40s", "b200"]


@pytest.mark.parametrize("name, mib", [("h100", 81_559), ("a100-80gb", 81_920), ("l40s", 46_068)])
def test_gpu_memory_is_the_device_reported_total(name, mib):
    assert load_gpu(name).memory_bytes == mib * MIB


def test_h200_memory_is_what_cuda_reports_on_the_profiled_device():
    # torch.cuda.get_device_properties(0).total_memory there (nvidia-smi shows 143,771 MiB)
    assert load_gpu("h200").memory_bytes == 150_109_880_320


@pytest.mark.parametrize("name", ["h200", "h100", "a100-80gb", "l40s", "b200"])
def test_every_gpu_figure_has_a_source(name):
    gpu = load_gpu(name)
    assert set(gpu.sources) == {"memory_bytes", "hbm_bandwidth_bytes_per_s", "bf16_flops_per_s",
                                "fp8_flops_per_s", "host_link_bytes_per_s"}
    assert all(source.strip() for source in gpu.sources.values())
    assert gpu.fp8_flops_per_s >= gpu.bf16_flops_per_s > 0


def test_h200_figures():
    gpu = load_gpu("h200")
    assert gpu.hbm_bandwidth_bytes_per_s == 4.8e12
    assert gpu.bf16_flops_per_s == 989.5e12
    assert gpu.fp8_flops_per_s == 1979e12
    assert gpu.host_link_bytes_per_s == 64e9
    assert gpu.flops_per_s("fp8") == 1979e12


def test_bundled_names_are_case_insensitive():
    assert load_model("Llama-3.1-8B").name == "llama-3.1-8b"
    assert load_gpu("H200").name == "h200"


def test_a_hub_id_is_not_fetched():
    with pytest.raises(InputError, match="reads local files only"):
        load_model("meta-llama/Llama-3.1-8B")


def test_unknown_gpu_suggests_the_closest():
    with pytest.raises(InputError, match="did you mean h100"):
        load_gpu("h10")


def test_profiles_dir_can_be_redirected_with_simkv_profiles(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    shutil.copy(profiles_dir() / "models" / "tiny.json", tmp_path / "models" / "mini.json")
    shutil.copy(profiles_dir() / "gpus.yaml", tmp_path / "gpus.yaml")
    monkeypatch.setenv("SIMKV_PROFILES", str(tmp_path))
    assert bundled_models() == ["mini"]
    assert load_model("mini").name == "mini"
