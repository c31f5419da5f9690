"""Tensor-parallel step cost: ring all-reduce arithmetic, one rank's roofline work, the measured
collectives' share of a TP profile's step."""
import json
import math
import shutil
from types import SimpleNamespace

import pytest

import simkv
from simkv.costmodel import load_cost_model
from simkv.costmodel.allreduce import AllReduce, StepCollectives, link_allreduce, read_measured
from simkv.costmodel.profiled import ProfiledCostModel
from simkv.costmodel.roofline import RooflineCostModel
from simkv.costmodel.tensor_parallel import TensorParallelProfiled, TensorParallelRoofline
from simkv.engine.plan import StepPlan
from simkv.errors import InputError
from simkv.specs import load_model, profiles_dir


def decode_plan(batch: int, context: int = 1000) -> StepPlan:
    """A decode-only step of `batch` sequences of `context` tokens each."""
    item = SimpleNamespace(start=context - 1, num_tokens=1, is_decode=True)
    return StepPlan(step=0, now_s=0.0, scheduled=[item] * batch, num_decode_tokens=batch,
                    decode_context_tokens=batch * context, decode_max_context=context)


def prefill_plan(tokens: int) -> StepPlan:
    return StepPlan(step=0, now_s=0.0, scheduled=[None], num_prefill_tokens=tokens,
                    num_prefill_seqs=1, prefill_attention_pairs=tokens * (tokens + 1) // 2)


def scenario(tp=1, model="llama-3.1-8b", cost_model="roofline"):
    return simkv.load_scenario({"model": model, "cost_model": cost_model,
                                "tensor_parallel_size": tp,
                                "workload": {"synthetic": {"num_requests": 4}}})


def test_a_ring_all_reduce_moves_2_p_minus_1_over_p_of_the_message():
    two = AllReduce(2, 400e9, 8e-6, "test")
    assert two.seconds(4e6) == pytest.approx(8e-6 + 4e6 / 400e9)            # 2(1)/2 = 1
    eight = AllReduce(8, 400e9, 8e-6, "test")
    assert eight.seconds(4e6) == pytest.approx(8e-6 + 1.75 * 4e6 / 400e9)   # 2(7)/8
    assert eight.gather_seconds(4e6) == pytest.approx(8e-6 + 0.875 * 4e6 / 400e9)


def test_measured_all_reduces_are_interpolated_and_extended(tmp_path):
    path = tmp_path / "allreduce.csv"
    path.write_text("message_bytes,seconds,rank\n1000,1e-5,0\n1000,3e-5,1\n1000,2e-5,0\n"
                    "3000,4e-5,0\n")
    ar = read_measured(path, 2)
    assert ar.sizes == (1000, 3000) and ar.seconds_at == (2e-5, 4e-5)      # medians
    assert ar.seconds(500) == 2e-5
    assert ar.seconds(2000) == pytest.approx(3e-5)
    assert ar.seconds(5000) == pytest.approx(6e-5)       # the last segment's slope, continued
    assert read_measured(tmp_path / "absent.csv", 2) is None


def test_a_malformed_measurement_names_the_file_and_row(tmp_path):
    path = tmp_path / "allreduce.csv"
    path.write_text("message_bytes,seconds\n1000,fast\n")
    with pytest.raises(InputError, match=r"allreduce.csv: row 2"):
        read_measured(path, 2)


def test_a_step_runs_two_all_reduces_per_layer_and_one_for_the_embedding():
    model = load_model("llama-3.1-8b")                    # 32 layers, hidden 4096
    ar = AllReduce(2, 400e9, 8e-6, "test")
    comm = StepCollectives(model, ar)
    assert comm.num_allreduces == 65
    rows = 64
    logits = 64 * 128256 * 2                              # vocab 128,256 (a multiple of 64)
    assert comm.seconds(rows, 64) == pytest.approx(
        65 * (8e-6 + rows * 4096 * 2 / 400e9) + 8e-6 + logits / 2 / 400e9)


def test_links_give_nvlink_within_a_board_and_infiniband_beyond():
    assert link_allreduce(8).bandwidth_bytes_per_s == 450e9
    assert link_allreduce(16).bandwidth_bytes_per_s == 50e9


def test_tp_1_loads_the_plain_roofline_without_a_collective_term():
    model = load_cost_model(scenario(1))
    assert type(model) is RooflineCostModel and "allreduce" not in model.term_names


def test_a_tp_step_is_one_ranks_roofline_plus_its_collectives():
    one, two = load_cost_model(scenario(1)), load_cost_model(scenario(2))
    assert isinstance(two, TensorParallelRoofline)
    plan = decode_plan(32)
    terms = two.cost(plan).terms
    assert terms["allreduce"] == two.collectives.seconds(32, 32)
    assert math.fsum(terms.values()) == two.predict(plan)
    # half the KV heads: half the KV read; about half the weights (norms are whole)
    assert terms["kv_read_write"] == pytest.approx(one.cost(plan).terms["kv_read_write"] / 2)
    assert 0.5 < two.weight_bytes / one.weight_bytes < 0.51
    assert two.attn_flops_per_pair == one.attn_flops_per_pair / 2


def test_a_long_prefill_at_tp_4_takes_about_a_quarter_of_the_flops():
    one, four = load_cost_model(scenario(1)), load_cost_model(scenario(4))
    plan = prefill_plan(8192)
    a, b = one.cost(plan).terms, four.cost(plan).terms
    assert b["linear"] / a["linear"] == pytest.approx(0.25, rel=0.01)
    assert b["prefill_attention"] == pytest.approx(a["prefill_attention"] / 4)


def test_tensor_parallel_experts_split_each_experts_width():
    one = load_cost_model(scenario(1, "qwen3-30b-a3b"))
    two = load_cost_model(scenario(2, "qwen3-30b-a3b"))
    plan = decode_plan(16)
    assert two.cost(plan).terms["experts"] == pytest.approx(
        one.cost(plan).terms["experts"] / 2, rel=1e-9)


# --- a TP profile: the measured collectives' share of its fitted step ---------------------------


@pytest.fixture
def tp_profile(tmp_path, monkeypatch):
    """profiles/ with the 8B's H200 fit copied as a TP 2 profile and measured all-reduces."""
    root = tmp_path / "profiles"
    shutil.copytree(profiles_dir() / "models", root / "models")
    for name in ("gpus.yaml", "links.yaml"):
        shutil.copy(profiles_dir() / name, root / name)
    folder = root / "h200" / "llama-3.1-8b-tp2"
    folder.mkdir(parents=True)
    shutil.copy(profiles_dir() / "h200" / "llama-3.1-8b" / "fit.json", folder / "fit.json")
    meta = json.loads((profiles_dir() / "h200" / "llama-3.1-8b" / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "tensor_parallel_size": 2}))
    (folder / "allreduce.csv").write_text(
        "message_bytes,seconds\n8192,6e-6\n1048576,9e-6\n67108864,2e-4\n")
    monkeypatch.setenv("SIMKV_PROFILES", str(root))
    return folder


def test_a_tp_profile_reports_its_measured_collectives_out_of_linear(tp_profile):
    scn = scenario(2, cost_model="auto")
    model = load_cost_model(scn)            # no clock.json in the copy: no clock effect
    assert isinstance(model, TensorParallelProfiled)
    plain = ProfiledCostModel.load(tp_profile, model=scn.model, gpu=scn.gpu,
                                   scheduler=scn.scheduler)
    plan = decode_plan(4)                   # graphed: padded to a captured batch size
    rows = model._graph_rows[4]
    terms = model.cost(plan).terms
    assert terms["allreduce"] == pytest.approx(
        65 * model.collectives.allreduce.seconds(rows * 4096 * 2)
        + model.collectives.allreduce.gather_seconds(4 * 128256 * 2))
    assert terms["linear"] + terms["allreduce"] == pytest.approx(
        plain.cost(plan).terms["linear"], rel=1e-12)
    assert model.layout.num_kv_heads == 4 and model.layout.num_heads == 16


def test_a_tp_profile_simulates_decode_runs_as_step_by_step(tp_profile):
    raw = {"model": "llama-3.1-8b", "tensor_parallel_size": 2, "seed": 1,
           "workload": {"synthetic": {"num_requests": 30, "arrival": {"process": "poisson",
                                                                     "rate": 20},
                                      "prompt_tokens": {"dist": "fixed", "value": 300},
                                      "output_tokens": {"dist": "fixed", "value": 40}}}}
    fast = simkv.simulate(simkv.load_scenario(raw)).summary
    exact = simkv.simulate(simkv.load_scenario(raw), exact=True).summary
    assert fast["cost_model"].startswith("profile:h200/llama-3.1-8b-tp2")
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        assert fast[key] == exact[key]


def test_a_profile_of_another_tensor_parallel_size_is_refused(tp_profile):
    meta = json.loads((tp_profile / "meta.json").read_text())
    (tp_profile / "meta.json").write_text(json.dumps({**meta, "tensor_parallel_size": 4}))
    with pytest.raises(InputError, match="profiled at tensor_parallel_size 4"):
        load_cost_model(scenario(2, cost_model="auto"))
