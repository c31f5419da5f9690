"""Per-layer attention types and KV cache groups sized as vLLM lays them out (docs/models.md,
"KV cache groups"); the figures below are worked by hand from the configs."""
from __future__ import annotations

import json

import pytest

from simkv import semantics as rules
from simkv.config.scenario import CacheConfig, SchedulerConfig
from simkv.errors import InputError
from simkv.kv_geometry import effective_block_size, kv_geometry
from simkv.sizing import size_pool
from simkv.specs import load_gpu, load_model, profiles_dir


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sizing(model: str, gpu: str = "h200", max_model_len=None, **cache):
    c, s = CacheConfig(**cache), SchedulerConfig(max_model_len=max_model_len)
    g = load_gpu(gpu)
    rules.resolve("vllm-0.26", c, s, g)
    return size_pool(load_model(model), g, c, s)


def write(tmp_path, base: str, **changes):
    config = json.loads((profiles_dir() / "models" / f"{base}.json").read_text())
    config.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


# --- specs ------------------------------------------------------------------------------------

def test_gemma_3_slides_on_five_of_every_six_layers():
    m = load_model("gemma-3-27b")
    full = [i for i, t in enumerate(m.attention_types) if t == "full_attention"]
    assert full == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert m.sliding_window == 1024 and m.num_layers == 62


def test_qwen3_next_has_linear_attention_on_three_of_four_layers():
    m = load_model("qwen3-next-80b-a3b")
    assert m.attention_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert m.num_attention_layers == 12
    # conv: (2 x 16 x 128 + 32 x 128) channels x 3; recurrent: 32 x 128 x 128; bf16
    assert m.linear_state_bytes() == ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128) * 2


def test_a_qwen_sliding_window_without_use_sliding_window_stays_full_attention():
    m = load_model("qwen2.5-7b")
    assert m.sliding_window is None and set(m.attention_types) == {"full_attention"}


def test_parameter_counts_are_the_published_ones():
    # model cards: Gemma 3 27B 27,432,406,640 (text + SigLIP tower + projector); DeepSeek-V2-Lite
    # 15.7B; Qwen3-Next-80B-A3B 79,674,391,296 total, 3,874,929,408 active
    assert load_model("gemma-3-27b").num_params == 27_432_406_640
    assert round(load_model("deepseek-v2-lite").num_params / 1e9, 1) == 15.7
    nxt = load_model("qwen3-next-80b-a3b")
    assert (nxt.num_params, nxt.active_params) == (79_674_391_296, 3_874_929_408)


def test_an_unknown_model_type_is_refused(tmp_path):
    with pytest.raises(InputError, match="unknown model_type 'jamba'"):
        load_model(write(tmp_path, "llama-3.1-8b", model_type="jamba"))


def test_an_unknown_layer_type_is_refused_naming_its_index(tmp_path):
    types = ["sliding_attention", "full_attention"] * 12
    types[3] = "chunked_attention"
    with pytest.raises(InputError, match="'layer_types' entry 3 is 'chunked_attention'"):
        load_model(write(tmp_path, "gpt-oss-20b", layer_types=types))


def test_a_sliding_layer_needs_its_window(tmp_path):
    with pytest.raises(InputError, match="missing required field 'sliding_window'"):
        load_model(write(tmp_path, "gpt-oss-20b", sliding_window=None))


# --- groups and the pool ----------------------------------------------------------------------

def test_a_full_attention_model_is_one_group_with_the_seed_formula():
    s = sizing("llama-3.1-8b")
    assert len(s.kv_groups) == 1 and s.kv_groups[0]["num_layers"] == 32
    assert s.bytes_per_block == 2 * 32 * 8 * 128 * 2 * 16
    assert s.max_cached_tokens == s.num_blocks * 16


def test_gpt_oss_pool_block_holds_twelve_layers_and_a_request_needs_both_groups():
    s = sizing("gpt-oss-20b", max_model_len=8192)
    page = 16 * 2 * 8 * 64 * 2                      # one layer's block: 32,768 bytes
    assert (s.page_bytes, s.layers_per_group) == (page, 12)
    assert s.bytes_per_block == 12 * page
    assert s.num_gpu_blocks == s.kv_pool_bytes // page // 12
    full = cdiv(8192, 16)
    window = cdiv(min(128 - 1 + 8192, 8192), 16) + 1          # the chunk may be 8,192 tokens
    assert s.blocks_per_request == full + window == 1025
    assert s.max_concurrency == pytest.approx(s.num_gpu_blocks / 1025)


def test_gemma_3_has_one_full_group_and_six_window_groups_of_ten_layer_slots():
    g = kv_geometry(load_model("gemma-3-27b"), 2 * 16 * 128 * 2, 16, 131072)
    assert g.group_size == 10                        # the 10 full-attention layers
    kinds = [(x.kind, len(x.layers)) for x in g.groups]
    assert kinds == [("sliding", 9)] * 4 + [("sliding", 8)] * 2 + [("full", 10)]
    assert g.bytes_per_block == 10 * 16 * 2 * 16 * 128 * 2


def test_qwen3_next_attention_block_grows_until_a_page_holds_a_state():
    m = load_model("qwen3-next-80b-a3b")
    state, per_token = 1_097_728, 2 * 2 * 256 * 2
    assert effective_block_size(m, "h200", 16, 4096) == 16 * cdiv(state, 16 * per_token) == 544
    g = kv_geometry(m, per_token, 544, 4096, state)
    assert g.page_bytes == 544 * per_token and g.group_size == 12
    assert [x.kind for x in g.groups] == ["linear"] * 3 + ["full"]
    assert g.blocks_per_request(4096, 8192) == cdiv(4096, 544) + 3   # one state block per group


def test_mla_runs_64_token_blocks_on_hopper_only():
    m = load_model("deepseek-v2-lite")
    assert effective_block_size(m, "h200", 16, 4096) == 64
    assert effective_block_size(m, "h200", 128, 4096) == 128
    assert effective_block_size(m, "a100-80gb", 16, 4096) == 16
    s = sizing("deepseek-v2-lite")
    assert (s.block_size, s.bytes_per_block) == (64, 27 * 64 * (512 + 64) * 2)
