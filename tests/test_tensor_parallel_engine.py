"""The sample engine in tensor parallel on CPU (gloo, one process per rank): the tiny model's
greedy tokens at TP 2 and 4 are TP 1's in float32, and each rank's shards are slices of the
one-GPU model's weights."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from simkv import parallel  # noqa: E402
from simkv.errors import InputError  # noqa: E402
from simkv.gpu import tensor_parallel  # noqa: E402
from simkv.gpu.engine import Engine, run_offline  # noqa: E402
from simkv.gpu.model import LlamaModel  # noqa: E402
from simkv.specs import load_model  # noqa: E402
from tests.test_engine_cpu import scenario, workload  # noqa: E402
from tests.test_moe_engine import write_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def ranks(world_size: int) -> list:
    """Every rank's shards of the tiny model (building them needs no process group)."""
    spec = load_model("tiny")
    return [tensor_parallel.TensorParallelLlama(spec, dtype=torch.float32, rank=r,
                                                world_size=world_size)
            for r in range(world_size)]


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_ranks_generate_the_one_gpu_engines_greedy_tokens_in_float32(tp):
    frame = workload()
    overrides = {"cache.enable_prefix_caching": True}
    one = run_offline(scenario(**overrides), frame, dtype=torch.float32, check_integrity=False)
    many = tensor_parallel.run_offline(
        scenario(**overrides, tensor_parallel_size=tp), frame, dtype=torch.float32)
    assert many["step_tokens"] == one.step_tokens
    assert many["tokens"] == one.tokens
    assert len(one.tokens) == 15                     # 12 requests, three of them n = 2


def test_tp_2_splits_every_experts_width_and_keeps_the_tokens(tmp_path):
    # the tiny Qwen3-MoE of tests/test_moe_engine.py: 8 experts of width 32, top 2
    frame = workload()
    path = write_config(tmp_path)
    one = run_offline(scenario(model=str(path)), frame, dtype=torch.float32,
                      check_integrity=False)
    two = tensor_parallel.run_offline(scenario(model=str(path), tensor_parallel_size=2), frame,
                                      dtype=torch.float32)
    assert two["tokens"] == one.tokens and len(one.tokens) == 15


def test_each_rank_holds_its_heads_and_features_of_the_one_gpu_weights():
    full = LlamaModel(load_model("tiny"), dtype=torch.float32)      # 4 heads, 2 KV heads of 16
    a, b = ranks(2)
    q = lambda m: m.layers[0].qkv[:m.num_heads * 16]                 # noqa: E731
    assert torch.equal(torch.cat([q(a), q(b)]), q(full))
    assert torch.equal(torch.cat([a.layers[1].o, b.layers[1].o], dim=1), full.layers[1].o)
    assert torch.equal(torch.cat([a.layers[0].down, b.layers[0].down], dim=1),
                       full.layers[0].down)
    assert torch.equal(torch.cat([a.lm_head, b.lm_head]), full.lm_head)   # vocab 256: no pad
    assert torch.equal(a.final_norm, full.final_norm)


def test_with_fewer_kv_heads_than_ranks_each_kv_head_is_on_two_ranks():
    full = LlamaModel(load_model("tiny"), dtype=torch.float32)
    four = ranks(4)
    k = lambda m, head: m.layers[0].qkv[(m.num_heads + head) * 16:(m.num_heads + head + 1) * 16]  # noqa: E731,E501
    assert [m.num_kv_heads for m in four] == [1, 1, 1, 1]
    assert [m.kv_head0 for m in four] == [0, 0, 1, 1]
    for m in four:
        assert torch.equal(k(m, 0), k(full, m.kv_head0))


def test_a_rank_holds_the_parameters_sizing_counts_for_it():
    for tp in (2, 4):
        held = sum(t.numel() for t in ranks(tp)[0].parameters())
        assert held == sum(parallel.rank_params_by_part(load_model("tiny"), tp).values())


def test_the_one_process_engine_refuses_a_tensor_parallel_scenario():
    with pytest.raises(InputError, match="one process per rank"):
        Engine(scenario(tensor_parallel_size=2), "cpu")
