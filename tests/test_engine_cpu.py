"""The real engine on CPU: the bundled `tiny` model in float64 with the torch reference attention.

Greedy decoding in float64 is exact enough that any difference in the tokens means the engine
computed something wrong (a stale block table, a missed copy-on-write, a bad swap mapping), and
the poisoning debug mode turns every read of a freed block into an error. The workload: 12
requests, all arriving at 0, two families sharing prefixes, three of them with n = 2.
"""
import json
import os

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():   # the kernels (triton test below) need the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import simkv  # noqa: E402
from simkv.workload.traces import build_trace  # noqa: E402
from simkv.gpu.engine import replay, requests_from_frame, run_offline  # noqa: E402
from simkv.gpu.tokens import prompt_token_ids  # noqa: E402

PREFIX_BLOCK = 8   # tokens per trace prefix id


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def workload(arrivals=None, cancel_after_s=None) -> pd.DataFrame:
    """12 requests: family A shares 3 prefix blocks, family B 2; n = 2 for three of them."""
    families = {"A": (1, 2, 3), "B": (11, 12), None: ()}
    #          family, prompt, output, n
    spec = [("A", 30, 9, 1), ("A", 27, 6, 2), ("B", 21, 8, 1), (None, 13, 7, 1),
            ("A", 35, 5, 1), ("B", 19, 10, 2), (None, 9, 4, 1), ("A", 25, 8, 1),
            ("B", 23, 6, 1), (None, 17, 9, 2), ("A", 31, 7, 1), ("B", 20, 5, 1)]
    next_id = 100
    ids = []
    for family, prompt, _, _ in spec:
        blocks = -(-prompt // PREFIX_BLOCK)
        shared = families[family][:prompt // PREFIX_BLOCK]
        ids.append(shared + tuple(range(next_id, next_id + blocks - len(shared))))
        next_id += blocks
    columns = {"arrival_s": np.zeros(12) if arrivals is None else arrivals,
               "prompt_tokens": [s[1] for s in spec], "output_tokens": [s[2] for s in spec],
               "n": [s[3] for s in spec], "prefix_ids": ids,
               "prefix_block_tokens": [PREFIX_BLOCK] * 12}
    if cancel_after_s is not None:
        columns["cancel_after_s"] = cancel_after_s
    return build_trace(columns, source="test", format="csv")


def scenario(**overrides):
    """Block size 4, 32 tokens per step (long prompts are chunked), at most 8 sequences."""
    raw = {"name": "engine-cpu", "model": "tiny", "gpu": "h200", "seed": 0,
           "cache": {"block_size": 4, "num_gpu_blocks_override": 256,
                     "enable_prefix_caching": False, "swap_space_gib": 0.001},
           "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 48},
           "workload": {"synthetic": {"num_requests": 12, "output_tokens": 4,
                                      "prompt_tokens": {"dist": "fixed", "value": 8}}}}
    return simkv.load_scenario(raw, overrides)


TIGHT = {"cache.num_gpu_blocks_override": 24, "cache.enable_prefix_caching": True}
FORK = {"scheduler.parallel_sampling": "fork"}     # semantics vllm-0.18's forks
CONFIGS = {
    "ample": {},
    "forked": FORK,
    "prefix_caching": {"cache.enable_prefix_caching": True},
    "tight_recompute": TIGHT,
    "tight_swap": {**TIGHT, "cache.preemption_mode": "swap"},
}


@pytest.fixture(scope="module")
def runs():
    frame = workload()
    return {name: run_offline(scenario(**over), frame, dtype=torch.float64,
                              attention="reference", poison=True)
            for name, over in CONFIGS.items()}


def test_every_sample_generates_its_output_length(runs):
    tokens = runs["ample"].tokens
    frame = workload()
    assert len(tokens) == int(frame["n"].sum()) == 15
    for rid, output, n in zip(frame["request_id"], frame["output_tokens"], frame["n"]):
        for sample in range(n):
            assert len(tokens[(rid, sample)]) == output
            assert all(0 <= t < 256 for t in tokens[(rid, sample)])


def test_prefix_caching_leaves_greedy_tokens_unchanged(runs):
    assert runs["prefix_caching"].result.summary["cached_tokens"] > 0
    assert runs["prefix_caching"].tokens == runs["ample"].tokens


def test_recompute_preemption_leaves_greedy_tokens_unchanged(runs):
    run = runs["tight_recompute"]
    assert run.preemptions > 0
    assert run.result.summary["recomputed_tokens"] > 0
    assert run.tokens == runs["ample"].tokens


def test_swap_mode_allocates_the_whole_host_swap_space_up_front():
    from simkv.gpu.engine import Engine
    swap = Engine(scenario(**CONFIGS["tight_swap"]), "cpu", dtype=torch.float64,
                  attention="reference")
    ex = swap.executor
    assert ex.num_host_blocks > 0 and ex.swap_space is not None
    assert ex.swap_space.num_blocks == ex.num_host_blocks
    # recompute mode never swaps: no host space
    assert Engine(scenario(**CONFIGS["tight_recompute"]), "cpu", dtype=torch.float64,
                  attention="reference").executor.swap_space is None


def test_swap_preemption_leaves_greedy_tokens_unchanged(runs):
    run = runs["tight_swap"]
    assert run.preemptions > 0
    assert run.result.summary["swapped_out_blocks"] > 0
    assert run.result.summary["swapped_in_blocks"] > 0
    assert run.tokens == runs["ample"].tokens


def test_forked_samples_copy_their_shared_tail_block(runs):
    assert runs["forked"].result.summary["cow_copies"] > 0
    assert runs["ample"].result.summary["cow_copies"] == 0     # fanned out: nothing shared


def test_forks_and_fanned_out_children_sample_the_same_greedy_tokens(runs):
    assert runs["forked"].tokens == runs["ample"].tokens


def test_nothing_leaks(runs):
    for run in runs.values():
        assert run.result.summary["leaked_blocks"] == 0
        assert run.result.summary["requests_completed"] == 12


@pytest.mark.parametrize("config", list(CONFIGS))
def test_engine_steps_match_the_simulator(config, runs):
    pytest.importorskip("simpy")
    from simkv.sim.engine import simulate
    sim = simulate(scenario(**CONFIGS[config]), trace_df=workload())
    sim_steps = list(zip(sim.steps["num_prefill_tokens"], sim.steps["num_decode_tokens"]))
    assert runs[config].step_tokens == sim_steps
    assert runs[config].preemptions == sim.summary["preemptions"]
    assert runs[config].result.summary["cached_tokens"] == sim.summary["cached_tokens"]


def test_poisoning_turns_a_missed_copy_on_write_into_an_error(monkeypatch):
    from simkv.engine.kv.paged import PagedKVCacheManager
    monkeypatch.setattr(PagedKVCacheManager, "take_copies", lambda self: [])
    with pytest.raises(FloatingPointError):
        run_offline(scenario(**FORK), workload(), dtype=torch.float64, attention="reference",
                    poison=True)


def test_poisoning_turns_a_lost_swap_in_into_an_error(monkeypatch):
    from simkv.gpu import swap
    monkeypatch.setattr(swap, "swap_in", lambda caches, space, mapping: None)
    with pytest.raises(FloatingPointError):
        run_offline(scenario(**CONFIGS["tight_swap"]), workload(), dtype=torch.float64,
                    attention="reference", poison=True)


class _Replayed:
    """Stands in for a CUDA graph on CPU: replay() re-runs the step into the captured outputs."""

    def __init__(self, step):
        self.step = step
        self.outputs = step()

    def replay(self):
        for out, new in zip(self.outputs, self.step()):
            out.copy_(new)


def graphed_cpu_executor(scn, **kwargs):
    """A CPU executor whose decode and mixed steps run as stand-in graphs over static inputs."""
    from simkv.gpu.executor import GpuExecutor
    num_blocks = scn.cache.num_gpu_blocks_override
    executor = GpuExecutor(scn.model, num_blocks, scn.cache.block_size, num_host_blocks=64,
                           device="cpu", max_num_seqs=scn.scheduler.max_num_seqs,
                           max_model_len=scn.scheduler.max_model_len,
                           max_num_batched_tokens=scn.scheduler.max_num_batched_tokens,
                           poison=True, static_inputs=True, **kwargs)
    steps = executor.steps
    for b in steps.decode_buckets():
        graph = _Replayed(steps.decode_step(b))
        steps.decode_graphs[b] = (graph, *graph.outputs)
    for t in steps.mixed_buckets():
        graph = _Replayed(steps.mixed_step(t))
        steps.mixed_graphs[t] = (graph, *graph.outputs)
    steps.use_graphs = True
    return executor


@pytest.mark.parametrize("config", ["ample", "prefix_caching", "tight_swap"])
def test_graphed_static_inputs_reproduce_the_eager_tokens(config, runs):
    # decode graphs and mixed-step graphs (decodes first, chunks, padding rows) give the tokens
    # of the eager engine, with preemption, copy-on-write and prefix hits in the run
    scn = scenario(**CONFIGS[config])
    executor = graphed_cpu_executor(scn, dtype=torch.float64, attention="reference")
    run = run_offline(scn, workload(), executor=executor, poison=True)
    assert executor.num_graph_steps > 0 and executor.num_mixed_graph_steps > 0
    assert executor.num_eager_steps == 0       # every step of <= 32 tokens fits a graph
    assert run.step_tokens == runs[config].step_tokens
    assert run.tokens == runs["ample"].tokens


def test_mixed_steps_too_large_for_a_graph_run_eagerly():
    from simkv import launch_policy
    scn = scenario(**{"scheduler.max_num_batched_tokens": 32})
    executor = graphed_cpu_executor(scn, dtype=torch.float64, attention="reference")
    steps = executor.steps
    assert steps.mixed_buckets() == [16, 32]
    assert steps.mixed_bucket(1, 3, 17) == 32
    assert steps.mixed_bucket(1, 3, 33) is None
    assert steps.mixed_bucket(9, 0, 20) is None       # more chunks than the capacity (8)
    assert launch_policy.MIXED_TOKEN_SIZES[-1] == 2048


def test_equal_prefix_ids_give_equal_tokens_and_the_rest_is_the_requests_own():
    a, b, c = requests_from_frame(workload())[:3]      # A (30 tokens), A (27), B (21)
    ta, tb, tc = (prompt_token_ids(r, 256) for r in (a, b, c))
    shared = 3 * PREFIX_BLOCK                            # family A shares 3 trace blocks
    assert ta[:shared] == tb[:shared]
    assert ta[shared:27] != tb[shared:27]
    assert ta[:PREFIX_BLOCK] != tc[:PREFIX_BLOCK]
    assert len(ta) == 30 and all(0 <= t < 256 for t in ta)
    assert prompt_token_ids(a, 256) == ta                # deterministic
    assert prompt_token_ids(a, 256, seed=1) != ta


def test_replay_writes_the_simulators_result_files_and_tokens(tmp_path):
    pytest.importorskip("simpy")
    from simkv.sim.engine import simulate
    scn = scenario(**CONFIGS["prefix_caching"])
    frame = workload()
    res = replay(scn, device="cpu", out_dir=tmp_path, save_tokens=True, realtime=False,
                 trace_df=frame, dtype=torch.float64, attention="reference")
    sim = simulate(scn, trace_df=frame)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(sim.summary) - {"cost_model_note"} <= set(summary)
    assert summary["cost_model"] == "measured"
    assert list(pd.read_csv(tmp_path / "requests.csv").columns) == list(sim.requests.columns)
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert list(steps.columns[:len(sim.steps.columns)]) == list(sim.steps.columns)
    assert (steps["gpu_s"] > 0).all() and (steps["duration_s"] >= steps["gpu_s"]).all()
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert ledger["kv_pool_bytes"] == 2 * 2 * 256 * 4 * 2 * 16 * 8   # layers,K/V,blocks,bs,kvh,d,f64
    rows = [json.loads(line) for line in (tmp_path / "tokens.jsonl").read_text().splitlines()]
    assert len(rows) == 15
    assert {(r["request_id"], r["sample"]): r["token_ids"] for r in rows} == res.tokens


def test_realtime_replay_honours_arrivals_and_cancellations():
    arrivals = np.linspace(0.0, 0.22, 12)
    cancel = np.full(12, np.nan)
    cancel[5] = 0.0                      # cancelled as it arrives
    res = replay(scenario(), device="cpu", trace_df=workload(arrivals, cancel),
                 dtype=torch.float64, attention="reference")
    status = res.requests.set_index("request_id")["status"]
    assert status[5] == "cancelled"
    assert (status.drop(5) == "completed").all()
    first = res.requests.set_index("request_id")["first_token_s"].drop(5)
    assert (first.to_numpy() >= arrivals[first.index.to_numpy()]).all()
    assert res.summary["sim_duration_s"] >= 0.22
    assert res.summary["leaked_blocks"] == 0


def test_llama3_rope_scaling_slows_only_the_low_frequencies():
    from simkv.specs import load_model
    from simkv.gpu.model import rope_inv_freq
    spec = load_model("llama-3.1-8b")
    scaled = rope_inv_freq(spec)
    plain = 1.0 / (spec.rope_theta ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    wavelen = 2 * torch.pi / plain
    assert torch.equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
    assert torch.allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)
    between = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert ((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8)).all()


def test_triton_path_matches_the_reference_under_the_interpreter():
    from simkv.gpu.kernels import INTERPRET
    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (CI sets it)")
    frame = workload().iloc[[0, 1, 5, 9]].copy()        # A, A n=2, B n=2, no prefix n=2
    frame["output_tokens"] = 3
    frame["request_id"] = range(4)
    scn = scenario(**{"cache.enable_prefix_caching": True})
    ref = run_offline(scn, frame, dtype=torch.float64, attention="reference", poison=True)
    tri = run_offline(scn, frame, device="cpu", dtype=torch.float32, attention="triton",
                      poison=True)
    assert tri.step_tokens == ref.step_tokens
    assert tri.tokens == ref.tokens
    # the kernels in the fixed-shape layout of the graphed steps (padding rows skipped)
    executor = graphed_cpu_executor(scn, dtype=torch.float32, attention="triton")
    graphed = run_offline(scn, frame, executor=executor, poison=True)
    assert executor.num_mixed_graph_steps > 0
    assert graphed.tokens == ref.tokens


def test_garbage_collection_is_held_off_inside_a_step_and_the_run_heap_frozen():
    # an automatic collection inside a host-bound eager step stalls its launches
    # (simkv.gpu.host); it is held off for the step and restored after, and the engine freezes
    # the heap alive before a run (unfrozen when it ends)
    import gc
    from simkv.gpu.engine import Engine
    engine = Engine(scenario(), "cpu", dtype=torch.float64, attention="reference")
    ex = engine.executor
    seen = []
    forward = ex.model.forward

    def watched(*args, **kwargs):
        seen.append((gc.isenabled(), gc.get_freeze_count() > 0))
        return forward(*args, **kwargs)

    ex.model.forward = watched
    assert gc.isenabled()
    engine.run(requests_from_frame(workload()), realtime=False)
    assert seen and all(enabled is False and frozen for enabled, frozen in seen)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()            # a caller's own choice survives a step
    try:
        engine.executor.execute(engine.scheduler.schedule(0.0))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_pinning_to_a_cpu_outside_the_allowed_set_is_a_clear_error():
    from simkv.errors import InputError
    from simkv.gpu.host import host_conditions, pin_to_cpu
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this system")
    allowed = os.sched_getaffinity(0)
    with pytest.raises(InputError, match="--pin-cpu"):
        pin_to_cpu(max(allowed) + 1000)
    pin_to_cpu(None)
    assert os.sched_getaffinity(0) == allowed
    assert host_conditions()["cpus_allowed"] == len(allowed)


def test_a_nested_frozen_heap_keeps_the_outer_one_frozen():
    import gc
    from simkv.gpu.host import frozen_heap
    with frozen_heap():
        outer = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() == outer > 0
    assert gc.get_freeze_count() == 0


def test_pinning_to_an_allowed_cpu_pins_and_a_system_without_affinity_says_so(monkeypatch):
    from simkv.errors import InputError
    from simkv.gpu.host import host_conditions, pin_to_cpu
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this system")
    allowed = os.sched_getaffinity(0)
    try:
        pin_to_cpu(min(allowed))
        assert os.sched_getaffinity(0) == {min(allowed)}
        assert host_conditions()["pinned_cpu"] == min(allowed)
    finally:
        os.sched_setaffinity(0, allowed)
    monkeypatch.delattr(os, "sched_setaffinity")
    with pytest.raises(InputError, match="cannot pin"):
        pin_to_cpu(0)


def test_the_serving_pass_times_the_host_around_real_time_steps():
    from simkv.specs import load_model
    from simkv.gpu.engine_pass import SERVING_FIELDS, measure_serving_host
    rows, info = measure_serving_host(load_model("tiny"), torch.device("cpu"), 0,
                                      lambda *a: None, rate_rps=2.0, num_requests=6,
                                      num_blocks=2000)
    df = pd.DataFrame(rows)[SERVING_FIELDS].apply(pd.to_numeric)
    # what the rows hold, not how long anything took: timings on a loaded CPU are whatever
    # the machine gives (no assertion here compares one measured time with another)
    assert info["requests"] == 6 and info["steps"] == len(df) > 6
    assert int(df["num_seqs"].max()) <= 6 and (df["num_seqs"] >= 1).all()
    assert (df[["duration_s", "exec_s", "prep_s"]] >= 0).all().all()
    # six significant digits each: outside_s is the difference of the two unrounded times, so
    # each of the three may be off by half a unit of its sixth digit (relative 5e-6)
    slack = 5e-6 * (df["outside_s"].abs() + df["duration_s"].abs() + df["exec_s"].abs())
    assert ((df["outside_s"] - (df["duration_s"] - df["exec_s"])).abs() <= slack + 1e-12).all()
    assert df["start_s"].is_monotonic_increasing


def test_the_engine_refuses_a_turn_that_continues_an_earlier_request():
    """A turn's prompt holds its parent's answer, which the engine has not generated when the
    prompt is made: turns are simulated only (docs/traces.md)."""
    from simkv.errors import InputError
    frame = workload()
    frame["parent_request_id"] = [-1] * len(frame)
    frame.loc[frame.index[-1], "parent_request_id"] = int(frame["request_id"].iloc[0])
    with pytest.raises(InputError, match="parent_request_id"):
        run_offline(scenario(), frame, dtype=torch.float64, attention="reference")
