"""KV sizing arithmetic: bytes per token and block, pool size, and the memory ledger."""
import json
import shutil

import pytest

from simkv.config.scenario import CacheConfig, SchedulerConfig
from simkv.sizing import (
    GIB,
    MIB,
    estimate_graph_pool_bytes,
    fit_error,
    memory_budget_bytes,
    seq_blocks,
    size_pool,
    wasted_slots,
)
from simkv.specs import bundled_gpus, bundled_models, load_gpu, load_model, profiles_dir
from simkv.errors import InputError


# the limits the committed H200 ledgers were measured at (semantics vllm-0.18's defaults)
MEASURED = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}


def limits(**knobs) -> SchedulerConfig:
    return SchedulerConfig(**{**MEASURED, **knobs})


def sizing(model="llama-3.1-8b", gpu="h200", cache=None, scheduler=None):
    """Sized as simkv's engine holds its memory (its graphs and allocator reserve inside the
    budget: cache.pool_sizing engine) unless `cache` says otherwise."""
    return size_pool(load_model(model), load_gpu(gpu), cache or CacheConfig(pool_sizing="engine"),
                     scheduler or limits())


# --- the seeds of the Foundation issue ---------------------------------------------------------


def test_llama_8b_at_block_16_costs_128_kib_per_token_and_2_mib_per_block():
    s = sizing(cache=CacheConfig(block_size=16))
    assert s.bytes_per_token == 131_072             # 32 layers x 8 KV heads x 128 x 2 B x (K, V)
    assert s.bytes_per_block == 2 * MIB


def test_fp8_halves_bytes_per_token_and_per_block():
    s = sizing(cache=CacheConfig(block_size=16, kv_dtype="fp8"))
    assert s.bytes_per_token == 65_536
    assert s.bytes_per_block == 1 * MIB


def test_a_4096_token_sequence_costs_512_mib():
    s = sizing(cache=CacheConfig(block_size=16))
    assert seq_blocks(4096, 16) * s.bytes_per_block == 512 * MIB


def test_a_33_token_sequence_holds_3_blocks_and_wastes_15_slots():
    s = sizing(cache=CacheConfig(block_size=16))
    assert seq_blocks(33, 16) == 3
    assert wasted_slots(33, 16) == 15
    assert wasted_slots(33, 16) * s.bytes_per_token == 1.875 * MIB


@pytest.mark.parametrize("tokens, blocks, wasted", [(0, 0, 0), (1, 1, 15), (16, 1, 0), (17, 2, 15)])
def test_seq_blocks_rounds_up_to_whole_blocks(tokens, blocks, wasted):
    assert seq_blocks(tokens, 16) == blocks
    assert wasted_slots(tokens, 16) == wasted


# --- pool arithmetic for every bundled model x GPU that fits -----------------------------------

FITTING = [
    (m, g) for m in bundled_models() for g in bundled_gpus()
    if fit_error(sizing(m, g)) is None
]


def test_the_fitting_pairs_include_the_expected_extremes():
    assert ("llama-3.1-8b", "h200") in FITTING
    assert ("llama-3.1-70b", "b200") in FITTING       # 131 GiB of weights fit in 180 GB x 0.9
    assert ("llama-3.1-70b", "h100") not in FITTING
    assert ("qwen3-32b", "l40s") not in FITTING


@pytest.mark.parametrize("model, gpu", FITTING)
def test_num_blocks_is_the_pool_divided_by_block_bytes(model, gpu):
    s = sizing(model, gpu)
    assert s.kv_pool_bytes == s.memory_budget_bytes - s.weights_bytes - s.activation_bytes - s.other_bytes
    # one of the pool's blocks is vLLM's null block (semantics vllm-0.26)
    assert s.num_gpu_blocks == s.kv_pool_bytes // s.bytes_per_block
    assert s.num_blocks == s.num_gpu_blocks - 1
    # a token takes a slot in every KV group (one for a full-attention model)
    assert s.max_cached_tokens == s.num_blocks // len(s.kv_groups) * s.block_size


@pytest.mark.parametrize("model, gpu", FITTING)
def test_ledger_parts_add_up_to_the_device_memory(model, gpu):
    s = sizing(model, gpu)
    parts = {k: v for k, v in s.ledger.items() if k != "device_memory_bytes"}
    assert sum(parts.values()) == s.ledger["device_memory_bytes"] == load_gpu(gpu).memory_bytes
    assert 0 <= s.ledger["kv_pool_remainder_bytes"] < s.bytes_per_block


def test_budget_is_the_floor_of_utilisation_times_device_memory():
    gpu = load_gpu("h200")
    assert memory_budget_bytes(gpu, CacheConfig(gpu_memory_utilization=0.5)) == 150_109_880_320 // 2


def test_memory_budget_gib_wins_over_utilisation():
    s = sizing(cache=CacheConfig(gpu_memory_utilization=0.5, memory_budget_gib=60))
    assert s.memory_budget_bytes == 60 * GIB


def test_num_gpu_blocks_override_forces_the_pool_size():
    s = sizing(cache=CacheConfig(num_gpu_blocks_override=100))
    assert s.num_blocks == 100
    assert s.max_cached_tokens == 1600
    assert s.kv_pool_bytes == s.memory_budget_bytes - s.needed_bytes   # the pool itself is unchanged


def test_host_blocks_are_swap_space_divided_by_block_bytes():
    assert sizing(cache=CacheConfig(swap_space_gib=4)).num_host_blocks == 4 * GIB // (2 * MIB) == 2048


def test_swap_mode_reserves_the_staging_that_exceeds_the_forward_workspace(profiles):
    # the staging of two 128 MiB chunks is freed before the forward, whose workspace reuses it
    write_ledger(profiles)
    for tokens in (8192, 256):
        sched = SchedulerConfig(max_num_batched_tokens=tokens)
        recompute = sizing(cache=CacheConfig(preemption_mode="recompute"), scheduler=sched)
        swap = sizing(cache=CacheConfig(preemption_mode="swap"), scheduler=sched)
        extra = max(0, 256 * MIB - recompute.activation_bytes)
        assert swap.other_bytes - recompute.other_bytes == extra
        assert swap.ledger["swap_staging_bytes"] == extra
        assert "swap_staging_bytes" not in recompute.ledger
        assert recompute.num_blocks - swap.num_blocks == -(-extra // recompute.bytes_per_block) \
            or recompute.num_blocks - swap.num_blocks == extra // recompute.bytes_per_block
    assert extra > 0        # at 256 batched tokens the workspace is smaller than the staging


def test_estimated_activation_grows_with_the_token_budget(monkeypatch):
    monkeypatch.setattr("simkv.sizing.read_profile_ledger", lambda model, gpu, tp=1: None)
    small = sizing(scheduler=limits(max_num_batched_tokens=2048))
    large = sizing(scheduler=limits(max_num_batched_tokens=16384))
    assert large.activation_bytes > small.activation_bytes
    assert small.source == large.source == "estimate"
    # the graph pool grows with the captured mixed-step graphs (their logits and segments),
    # which stop at 2,048 tokens
    fewer = sizing(scheduler=limits(max_num_batched_tokens=512))
    assert fewer.other_bytes < small.other_bytes == large.other_bytes
    assert large.other_bytes == (768 + 256) * MIB + estimate_graph_pool_bytes(
        load_model("llama-3.1-8b"), limits(max_num_batched_tokens=16384))


@pytest.mark.parametrize("model", ["llama-3.1-8b", "llama-3.2-1b"])
def test_the_graph_pool_estimate_is_within_ten_percent_of_the_measured_pools(model):
    # the committed H200 ledgers measured the serving engine's graph pool at the defaults
    ledger = json.loads((profiles_dir() / "h200" / model / "ledger.json").read_text())
    measured = ledger["other_parts"]["cuda_graph_pool_bytes"]
    estimate = estimate_graph_pool_bytes(load_model(model), limits())
    assert abs(estimate - measured) <= 0.10 * measured


def test_estimated_activation_grows_with_the_model():
    assert sizing("llama-3.1-70b", "b200").activation_bytes > sizing("llama-3.1-8b").activation_bytes


def test_to_dict_has_the_keys_of_size_json():
    assert list(sizing().to_dict()) == [
        "model", "gpu", "block_size", "kv_dtype", "bytes_per_token", "bytes_per_block",
        "memory_budget_bytes", "weights_bytes", "activation_bytes", "other_bytes",
        "kv_pool_bytes", "num_blocks", "max_cached_tokens", "source", "ledger", "num_host_blocks",
        "ledger_file", "num_gpu_blocks", "total_params", "active_params", "weights_dtype",
        "quantization", "kv_groups", "page_bytes", "layers_per_group", "max_model_len",
        "blocks_per_request", "max_concurrency",
    ]


# --- fit errors --------------------------------------------------------------------------------


def test_a_model_bigger_than_the_budget_says_how_much_it_needs():
    s = sizing("llama-3.1-70b", "h100")
    message = fit_error(s)
    assert s.num_blocks == 0 and s.kv_pool_bytes < 0
    assert f"needs {s.needed_bytes / GIB:.1f} GiB" in message
    assert f"budget is {s.memory_budget_bytes / GIB:.1f} GiB" in message


def test_a_pool_smaller_than_one_max_model_len_sequence_is_an_error():
    s = sizing(cache=CacheConfig(num_gpu_blocks_override=10))
    assert fit_error(s, max_model_len=160) is None
    assert fit_error(s, max_model_len=161) == (
        "pool holds 160 tokens (10 blocks of 16); max_model_len is 161: lower "
        "scheduler.max_model_len or raise the budget"
    )


# --- a measured memory ledger replaces the estimate --------------------------------------------


@pytest.fixture
def profiles(tmp_path, monkeypatch):
    """A copy of the bundled profiles/ folder that tests may add ledgers to."""
    shutil.copytree(profiles_dir() / "models", tmp_path / "models")
    shutil.copy(profiles_dir() / "gpus.yaml", tmp_path / "gpus.yaml")
    monkeypatch.setenv("SIMKV_PROFILES", str(tmp_path))
    return tmp_path


def write_ledger(profiles, **values):
    folder = profiles / "h200" / "llama-3.1-8b"
    folder.mkdir(parents=True)
    ledger = {
        "weights_bytes": 16 * GIB,
        "activation_bytes_per_batched_token": 100_000,
        "activation_base_bytes": 200 * MIB,
        "other_bytes": 3 * GIB,
        "measured_on": "test",
    }
    ledger.update(values)
    (folder / "ledger.json").write_text(json.dumps(ledger))


def test_a_profile_ledger_replaces_the_estimate(profiles):
    write_ledger(profiles)
    s = sizing(scheduler=limits(max_num_batched_tokens=1000))
    assert s.source == "profile"
    assert s.weights_bytes == 16 * GIB
    assert s.activation_bytes == 200 * MIB + 1000 * 100_000
    assert s.other_bytes == 3 * GIB
    assert s.kv_pool_bytes == s.memory_budget_bytes - 16 * GIB - s.activation_bytes - 3 * GIB
    assert s.ledger_file.endswith("ledger.json")


def test_a_profile_only_applies_to_its_own_gpu_and_model(profiles):
    write_ledger(profiles)
    assert sizing("llama-3.1-8b", "h100").source == "estimate"
    assert sizing("qwen2.5-7b", "h200").source == "estimate"


def test_a_profile_ledger_missing_a_key_is_rejected_naming_the_file(profiles):
    write_ledger(profiles, other_bytes=None)
    with pytest.raises(InputError, match=r"h200/llama-3.1-8b/ledger.json: 'other_bytes'"):
        sizing()


def test_a_profiled_graph_pool_follows_the_scenarios_graph_sizes():
    # the committed ledger measured the pool of an engine with 256 sequences and 8,192 batched
    # tokens; an engine with max_num_seqs 16 captures fewer, smaller graphs
    default = sizing()
    small = sizing(scheduler=limits(max_num_seqs=16))
    assert default.source == small.source == "profile"
    model = load_model("llama-3.1-8b")
    fewer = (estimate_graph_pool_bytes(model, limits())
             - estimate_graph_pool_bytes(model, limits(max_num_seqs=16)))
    assert fewer > 0.5 * GIB
    assert default.other_bytes - small.other_bytes == fewer
    assert default.ledger["cuda_graph_pool_bytes"] - small.ledger["cuda_graph_pool_bytes"] == fewer
