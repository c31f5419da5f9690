"""Scenario loading: YAML into typed config, --set overrides, and validation at the boundary."""
import json
from pathlib import Path

import pytest
import yaml

from simkv.config.scenario import (
    CacheConfig,
    SchedulerConfig,
    apply_overrides,
    load_scenario,
    parse_set,
    scenario_to_dict,
    with_overrides,
)
from simkv.specs import profiles_dir
from simkv.errors import InputError

REPO = Path(__file__).resolve().parent.parent
SYNTHETIC = {"num_requests": 10, "arrival": {"process": "poisson", "rate": 1},
             "prompt_tokens": {"dist": "fixed", "value": 100},
             "output_tokens": {"dist": "fixed", "value": 10}}


def minimal(**sections):
    """The smallest valid scenario dict, with `sections` merged in."""
    scenario = {"model": "llama-3.1-8b", "workload": {"synthetic": dict(SYNTHETIC)}}
    scenario.update(sections)
    return scenario


def write(path: Path, scenario: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(scenario))
    return path


def error_of(scenario, overrides=None) -> str:
    with pytest.raises(InputError) as e:
        load_scenario(scenario, overrides)
    return str(e.value)


# --- loading -----------------------------------------------------------------------------------


def test_quickstart_loads_with_its_model_gpu_workload_and_slos():
    scn = load_scenario(REPO / "scenarios" / "quickstart.yaml")
    assert scn.name == "quickstart"
    assert (scn.model.name, scn.gpu.name) == ("llama-3.1-8b", "h200")
    assert scn.workload.synthetic["num_requests"] == 500
    assert scn.slo == {"ttft_s": 1.0, "tpot_s": 0.1}


def test_unset_keys_take_the_documented_defaults():
    scn = load_scenario(minimal())
    # the rules left null follow semantics vllm-0.26 (simkv.semantics)
    assert scn.semantics == "vllm-0.26"
    assert scn.cache == CacheConfig(null_block=True, duplicate_blocks=True, pool_sizing="vllm")
    assert scn.scheduler == SchedulerConfig(
        max_model_len=131072, max_num_seqs=1024, max_num_batched_tokens=8192,
        reserve_full_prompt=True, parallel_sampling="fanout", cap_output_tokens=True)
    assert (scn.gpu.name, scn.cost_model, scn.seed, scn.name) == ("h200", "auto", 0, "scenario")


def test_max_model_len_defaults_to_the_models_max_position_embeddings():
    assert load_scenario(minimal(model="mistral-7b-v0.3")).scheduler.max_model_len == 32768


def test_a_file_scenario_is_named_after_the_file_unless_it_names_itself(tmp_path):
    assert load_scenario(write(tmp_path / "busy.yaml", minimal())).name == "busy"
    assert load_scenario(write(tmp_path / "x.yaml", minimal(name="calm"))).name == "calm"


def test_trace_resolves_relative_to_the_scenario_file(tmp_path):
    (tmp_path / "scn" / "data").mkdir(parents=True)
    (tmp_path / "scn" / "data" / "t.csv").write_text("arrival_s,prompt_tokens,output_tokens\n")
    path = write(tmp_path / "scn" / "s.yaml", minimal(workload={"trace": "data/t.csv"}))
    assert load_scenario(path).workload.trace == tmp_path / "scn" / "data" / "t.csv"


def test_a_model_path_resolves_relative_to_the_scenario_file(tmp_path):
    folder = tmp_path / "models" / "my-model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((profiles_dir() / "models" / "tiny.json").read_text())
    path = write(tmp_path / "s.yaml", minimal(model="models/my-model/config.json"))
    assert load_scenario(path).model.name == "my-model"


def test_a_float_key_accepts_an_integer():
    scn = load_scenario(minimal(cache={"memory_budget_gib": 60}))
    assert scn.cache.memory_budget_gib == 60.0 and isinstance(scn.cache.memory_budget_gib, float)


def test_scenario_to_dict_is_json_serialisable():
    data = scenario_to_dict(load_scenario(REPO / "scenarios" / "quickstart.yaml"))
    assert json.loads(json.dumps(data))["cache"]["block_size"] == 16
    assert data["model"] == "llama-3.1-8b"


# --- overrides ---------------------------------------------------------------------------------


def test_parse_set_converts_by_the_target_fields_type():
    assert parse_set([
        "cache.block_size=32",
        "cache.gpu_memory_utilization=0.8",
        "cache.enable_prefix_caching=false",
        "cache.memory_budget_gib=null",
        "cache.allocator=contiguous",
        "slo.ttft_p90_s=0.5",
        "workload.synthetic.num_requests=100",
    ]) == {
        "cache.block_size": 32,
        "cache.gpu_memory_utilization": 0.8,
        "cache.enable_prefix_caching": False,
        "cache.memory_budget_gib": None,
        "cache.allocator": "contiguous",
        "slo.ttft_p90_s": 0.5,
        "workload.synthetic.num_requests": 100,
    }


@pytest.mark.parametrize("text, value", [("true", True), ("yes", True), ("1", True),
                                         ("False", False), ("no", False), ("0", False)])
def test_parse_set_reads_booleans_in_their_usual_spellings(text, value):
    assert parse_set([f"cache.enable_prefix_caching={text}"]) == {"cache.enable_prefix_caching": value}


def test_parse_set_rejects_an_item_without_equals():
    with pytest.raises(InputError, match=r"--set 'cache.block_size': expected KEY=VALUE"):
        parse_set(["cache.block_size"])


def test_parse_set_rejects_a_value_of_the_wrong_type():
    with pytest.raises(InputError, match=r"cache.block_size: expected an integer, got 'big'"):
        parse_set(["cache.block_size=big"])


def test_parse_set_rejects_an_unknown_key_with_a_suggestion():
    with pytest.raises(InputError, match=r"unknown key cache.blok_size \(did you mean cache.block_size\?\)"):
        parse_set(["cache.blok_size=32"])


def test_apply_overrides_sets_nested_keys_on_a_copy():
    raw = minimal()
    merged = apply_overrides(raw, {"cache.block_size": "32", "workload.synthetic.arrival.rate": 5})
    assert merged["cache"] == {"block_size": 32}
    assert merged["workload"]["synthetic"]["arrival"]["rate"] == 5
    assert "cache" not in raw and raw["workload"]["synthetic"]["arrival"]["rate"] == 1


def test_load_scenario_applies_overrides():
    scn = load_scenario(minimal(), {"cache.block_size": "32", "scheduler.max_num_seqs": 64})
    assert (scn.cache.block_size, scn.scheduler.max_num_seqs) == (32, 64)
    assert scn.raw["cache"]["block_size"] == 32


def test_with_overrides_revalidates_a_loaded_scenario():
    scn = load_scenario(REPO / "scenarios" / "quickstart.yaml")
    assert with_overrides(scn, {"cache.kv_dtype": "fp8"}).cache.kv_dtype == "fp8"
    assert scn.cache.kv_dtype == "bf16"


def test_an_error_in_an_overridden_key_names_set_not_the_file():
    assert error_of(minimal(), {"cache.block_size": 12}).startswith("--set: cache.block_size: 12")


# --- validation --------------------------------------------------------------------------------


def test_errors_name_the_file_and_the_dotted_key(tmp_path):
    path = write(tmp_path / "s.yaml", minimal(cache={"block_size": 12}))
    assert error_of(path) == (
        f"{path}: cache.block_size: 12 is not a positive power of two (8, 16, 32, ...)"
    )


def test_unknown_key_suggests_the_closest_valid_key():
    assert "unknown key cache.blok_size (did you mean cache.block_size?)" in error_of(
        minimal(cache={"blok_size": 16}))


def test_a_key_in_the_wrong_section_suggests_the_right_one():
    assert "(did you mean scheduler.max_num_seqs?)" in error_of(minimal(cache={"max_num_seqs": 8}))


def test_unknown_top_level_key_is_rejected():
    assert "unknown key cahce (did you mean cache?)" in error_of(minimal(cahce={}))


@pytest.mark.parametrize("key, value, expected", [
    ("block_size", 0, "0 is not in [1, 1,024]"),
    ("block_size", 24, "not a positive power of two"),
    ("gpu_memory_utilization", 0.0, "is not in (0, 1]"),
    ("gpu_memory_utilization", 1.5, "is not in (0, 1]"),
    ("watermark", 1.0, "is not in [0, 1)"),
    ("watermark", -0.1, "is not in [0, 1)"),
    ("memory_budget_gib", 0, "0 is not in (0, 4,096]"),
    ("swap_space_gib", -1, "-1 is not in [0, 4,096]"),
    ("num_gpu_blocks_override", 0, "0 is not in [1, 8,388,608]"),
    ("kv_dtype", "fp16", "'fp16' is not one of bf16, fp8"),
    ("allocator", "buddy", "'buddy' is not one of paged, contiguous"),
    ("preemption_mode", "kill", "'kill' is not one of recompute, swap"),
    ("prefix_sharing_scope", "user", "'user' is not one of tenant, global"),
    ("block_size", "sixteen", "expected an integer, got 'sixteen'"),
    ("block_size", True, "expected an integer, got True"),
    ("enable_prefix_caching", "maybe", "expected true or false"),
])
def test_cache_values_out_of_range_or_of_the_wrong_type_are_rejected(key, value, expected):
    message = error_of(minimal(cache={key: value}))
    assert f"cache.{key}: " in message and expected in message


@pytest.mark.parametrize("key, value, expected", [
    ("max_num_seqs", 0, "0 is not in [1, 65,536]"),
    ("max_num_batched_tokens", -5, "-5 is not in [1, 16,777,216]"),
    ("max_model_len", 0, "0 is not in [1, 16,777,216]"),
    ("long_prefill_token_threshold", -1, "-1 is not in [0, 16,777,216]"),
    ("preemption_policy", "oldest", "is not one of recent, priority"),
])
def test_scheduler_values_out_of_range_are_rejected(key, value, expected):
    message = error_of(minimal(scheduler={key: value}))
    assert f"scheduler.{key}: " in message and expected in message


def test_swap_preemption_needs_swap_space():
    assert "cache.swap_space_gib: must be > 0 when cache.preemption_mode is swap" in error_of(
        minimal(cache={"preemption_mode": "swap", "swap_space_gib": 0}))


def test_token_budget_below_max_num_seqs_is_rejected():
    assert "scheduler.max_num_batched_tokens: 128 is smaller than scheduler.max_num_seqs (256)" in (
        error_of(minimal(scheduler={"max_num_batched_tokens": 128, "max_num_seqs": 256})))


def test_a_default_max_num_seqs_is_capped_at_the_token_budget():
    """vllm/engine/arg_utils.py, EngineArgs._set_default_max_num_seqs_and_batched_tokens_args:
    a defaulted max_num_seqs is at most max_num_batched_tokens."""
    scn = load_scenario(minimal(scheduler={"max_num_batched_tokens": 128}))
    assert (scn.scheduler.max_num_seqs, scn.scheduler.max_num_batched_tokens) == (128, 128)


def test_without_chunked_prefill_the_token_budget_must_cover_max_model_len():
    message = error_of(minimal(scheduler={"enable_chunked_prefill": False}))
    assert "scheduler.max_num_batched_tokens: 8192 is smaller than max_model_len (131072)" in message
    ok = minimal(scheduler={"enable_chunked_prefill": False, "max_model_len": 8192})
    assert load_scenario(ok).scheduler.max_model_len == 8192


def test_max_model_len_beyond_the_models_context_is_rejected():
    assert "exceeds mistral-7b-v0.3's max_position_embeddings (32768)" in error_of(
        minimal(model="mistral-7b-v0.3", scheduler={"max_model_len": 65536}))


@pytest.mark.parametrize("key", ["ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s",
                                 "ttft_p90_s", "e2e_p99_s", "tpot_mean_s"])
def test_slo_keys_may_carry_a_percentile_or_mean(key):
    assert load_scenario(minimal(slo={key: 0.5})).slo == {key: 0.5}


@pytest.mark.parametrize("key", ["ttft", "latency_s", "ttft_p90", "ttft_p999_s", "ttft_max_s"])
def test_other_slo_keys_are_rejected(key):
    assert f"unknown SLO key slo.{key}" in error_of(minimal(slo={key: 0.5}))


def test_slo_values_must_be_positive_seconds():
    assert "slo.ttft_s: -1 is not in (0, 1,000,000,000]" in error_of(
        minimal(slo={"ttft_s": -1}))


def test_a_workload_needs_a_trace_or_a_synthetic_generator():
    message = error_of({"model": "llama-3.1-8b"})
    assert "workload: set workload.trace (a trace file) or workload.synthetic" in message


def test_a_workload_with_both_a_trace_and_a_generator_is_rejected():
    scenario = minimal(workload={"trace": "t.csv", "synthetic": SYNTHETIC})
    assert "not both" in error_of(scenario)


def test_a_missing_trace_file_is_rejected():
    assert "workload.trace: no such file" in error_of(minimal(workload={"trace": "nope.csv"}))


def test_a_missing_model_is_rejected():
    assert "<scenario>: model: missing" in error_of({"workload": {"synthetic": SYNTHETIC}})


def test_unknown_model_and_gpu_name_the_key_and_suggest():
    assert "model: unknown model 'llama-3.1-8': did you mean llama-3.1-8b?" in error_of(
        minimal(model="llama-3.1-8"))
    assert "gpu: unknown gpu 'a100': did you mean a100-80gb?" in error_of(minimal(gpu="a100"))


def test_a_model_too_big_for_the_budget_says_what_it_needs():
    message = error_of(minimal(model="llama-3.1-70b", gpu="h100"))
    assert "llama-3.1-70b needs 134.0 GiB" in message and "budget is 71.7 GiB" in message


def test_a_pool_smaller_than_max_model_len_is_rejected():
    message = error_of(minimal(cache={"num_gpu_blocks_override": 10}))
    assert message == ("<scenario>: pool holds 160 tokens (10 blocks of 16); max_model_len is "
                       "131072: lower scheduler.max_model_len or raise the budget")
    small = minimal(cache={"num_gpu_blocks_override": 10}, scheduler={"max_model_len": 160})
    assert load_scenario(small).cache.num_gpu_blocks_override == 10


def test_bad_yaml_names_the_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: llama-3.1-8b\ncache: {block_size: 16\n")
    assert error_of(path).startswith(f"{path}: bad YAML at line 3")


def test_python_tags_are_refused(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: !!python/object/apply:os.system ['true']\n")
    message = error_of(path)
    assert "python/ tags are not" in message


def test_an_empty_file_is_rejected(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("")
    assert "empty scenario" in error_of(path)


def test_a_missing_file_is_rejected(tmp_path):
    assert error_of(tmp_path / "nope.yaml") == f"{tmp_path / 'nope.yaml'}: no such scenario file"
