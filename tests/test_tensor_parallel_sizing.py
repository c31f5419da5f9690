"""Tensor-parallel sizing: one GPU's share of the weights, KV heads and workspace (vLLM's rules)."""
import json

import pytest

import simkv
from simkv import parallel
from simkv.config.scenario import CacheConfig, SchedulerConfig
from simkv.errors import InputError
from simkv.sizing import size_pool
from simkv.specs import bundled_models, load_gpu, load_model
from tests.test_cli_size import run, size_json

LIMITS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}


def sizing(model="llama-3.1-70b", tp=1, gpu="h200"):
    return size_pool(load_model(model), load_gpu(gpu), CacheConfig(), SchedulerConfig(**LIMITS),
                     tensor_parallel_size=tp)


def scenario(tp=None, **extra):
    raw = {"model": "llama-3.1-70b", "workload": {"synthetic": {"num_requests": 4}},
           **extra}
    if tp is not None:
        raw["tensor_parallel_size"] = tp
    return raw


def test_llama_70b_weights_per_gpu_at_tp_2_are_its_shards_by_hand():
    # hidden 8192, 64 heads and 8 KV heads of 128, MLP 28,672, vocab 128,256, 80 layers, bf16
    L, H, I, V = 80, 8192, 28672, 128256
    per_layer = (64 // 2 * 128 * H           # q_proj: half the heads
                 + 2 * (8 // 2 * 128 * H)    # k_proj, v_proj: half the KV heads
                 + H * 64 // 2 * 128         # o_proj: half its input features
                 + 3 * (I // 2 * H)          # gate, up (rows) and down (cols) halved
                 + 2 * H)                    # the two norms, whole
    params = L * per_layer + H + 2 * (V // 2 * H)   # final norm; embedding and LM head halves
    assert sizing(tp=2).weights_bytes == 2 * params


def test_kv_heads_split_until_each_gpu_holds_one_then_replicate():
    per_head = 2 * 80 * 128 * 2                      # K and V, 80 layers, 128 wide, bf16
    assert sizing(tp=1).bytes_per_token == 8 * per_head
    assert sizing(tp=2).bytes_per_token == 4 * per_head
    assert sizing(tp=8).bytes_per_token == per_head
    s16 = sizing(tp=16)
    assert s16.bytes_per_token == per_head           # one KV head on each of 16 GPUs
    assert s16.to_dict()["bytes_per_token_total"] == 16 * per_head   # each head twice


def test_an_mla_latent_is_whole_on_every_gpu():
    one = load_model("deepseek-v3")
    assert parallel.kv_bytes_per_token(one, "bf16", 8) == one.kv_bytes_per_token("bf16")


def test_the_vocabulary_is_padded_to_64_then_split():
    assert parallel.padded_vocab_rows(128256, 2) == 64128        # already a multiple of 64
    assert parallel.padded_vocab_rows(32001, 2) == 32064 // 2    # 32,001 -> 32,064
    assert parallel.padded_vocab_rows(32001, 1) == 32064


def test_tp_1_sizes_every_bundled_model_as_without_tensor_parallelism():
    for name in bundled_models():
        model = load_model(name)
        if parallel.check(model, 1) is None:
            base = size_pool(model, load_gpu("b200"), CacheConfig(), SchedulerConfig(**LIMITS))
            assert sizing(name, tp=1, gpu="b200") == base
            assert "tensor_parallel_size" not in base.to_dict()


def test_only_norms_and_padding_are_held_more_than_once():
    model = load_model("llama-3.1-8b")                            # vocab 128,256: no padding
    norms = model.params_by_part()["norm"]
    for tp in (2, 4, 8, 16):
        per_rank = parallel.rank_params_by_part(model, tp)
        assert per_rank["norm"] == norms
        assert sum(per_rank.values()) * tp - norms * (tp - 1) == model.num_params \
            + _replicated_kv_params(model, tp)


def _replicated_kv_params(model, tp):
    """Parameters of the k/v projections held again by the ranks that share a KV head."""
    copies = max(1, tp // model.num_kv_heads) - 1
    return copies * 2 * model.num_kv_heads * model.head_dim * model.hidden_size \
        * model.num_layers


def test_more_gpus_leave_more_kv_blocks_per_gpu():
    blocks = [sizing(tp=tp).num_blocks for tp in (2, 4, 8)]
    assert blocks == sorted(blocks) and len(set(blocks)) == 3


def test_totals_are_per_gpu_figures_times_the_gpus():
    d = sizing(tp=4).to_dict()
    assert d["tensor_parallel_size"] == 4
    for key in ("bytes_per_token", "weights_bytes", "num_blocks", "kv_pool_bytes"):
        assert d[f"{key}_total"] == 4 * d[key]


def test_a_70b_does_not_fit_one_h200_and_fits_two():
    assert sizing(tp=1).num_blocks == 0
    assert sizing(tp=2).num_blocks > 0


@pytest.mark.parametrize("tp, words", [(3, "does not divide"), (17, "1..16"), (0, "1..16")])
def test_a_size_that_cannot_split_the_model_is_refused_naming_the_key(tp, words):
    with pytest.raises(InputError, match=f"tensor_parallel_size: .*{words}"):
        simkv.load_scenario(scenario(tp))


def test_kv_heads_that_neither_divide_nor_are_divided_by_the_ranks_are_refused(tmp_path):
    assert parallel.check(load_model("tiny"), 4) is None     # 2 KV heads: each on 2 GPUs
    config = json.loads(load_model("tiny").path.read_text())
    config.update(num_attention_heads=24, num_key_value_heads=6, head_dim=16)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert "cannot share" in parallel.check(load_model(str(path)), 4)
    assert parallel.check(load_model(str(path)), 2) is None and \
        parallel.check(load_model(str(path)), 12) is not None   # 12 does not divide MLP 128


def test_the_scenario_and_each_pool_carry_their_tensor_parallel_size():
    scn = simkv.load_scenario(scenario(2, cluster={"pools": [
        {"name": "a", "replicas": 1}, {"name": "b", "replicas": 1, "tensor_parallel_size": 4}]}))
    assert scn.tensor_parallel_size == 2
    a, b = (p.scenario for p in scn.cluster.pools)
    assert (a.tensor_parallel_size, b.tensor_parallel_size) == (2, 4)
    assert simkv.load_scenario(scenario(), overrides={"tensor_parallel_size": 8}) \
        .tensor_parallel_size == 8


def test_the_70b_scenario_without_tensor_parallelism_says_it_does_not_fit():
    with pytest.raises(InputError, match="tensor-parallel GPUs"):
        simkv.load_scenario(scenario())


def test_size_json_gives_per_gpu_figures_and_totals():
    d = size_json("--model", "llama-3.1-70b", "--tensor-parallel-size", "4")
    assert d["tensor_parallel_size"] == 4
    assert d["bytes_per_token"] == 2 * 80 * 2 * 128 * 2
    assert d["weights_bytes_total"] == 4 * d["weights_bytes"]


def test_size_with_an_impossible_tensor_parallel_size_is_one_error_line():
    proc = run("-m", "simkv.cli", "size", "--model", "llama-3.1-70b", "--tensor-parallel-size", "3")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --tensor-parallel-size: 3 does not divide llama-3.1-70b's num_attention_heads "
        "(64): use a size that does (1, 2, 4, 8, 16)"]


def test_a_model_with_tensors_no_split_rule_covers_is_refused_not_guessed():
    problem = parallel.check(load_model("gemma-3-27b"), 2)      # its vision tower
    assert "does not model yet" in problem and "vision_tower" in problem
    assert parallel.check(load_model("gemma-3-27b"), 1) is None
