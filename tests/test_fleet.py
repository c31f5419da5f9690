"""Fleets (`cluster:`): one replica is a plain run; round-robin replicas are separate runs of
their requests; routers, prefill/decode hand-offs and bad cluster input."""
import json

import numpy as np
import pytest

from simkv.cli import run_cli
from simkv.config.scenario import load_scenario
from simkv.engine.decode_run import DecodeRun
from simkv.engine.results import csv_text
from simkv.errors import InputError
from simkv.sim.cluster.router import assign
from simkv.sim.engine import simulate
from simkv.sim.executor import CostModelExecutor
from simkv.workload.frames import load_requests_frame
from tests.test_config import write

FLEET_ONLY = ("pools", "replicas", "router", "kv_transfer")


def scenario(num_requests=150, rate=30.0, cancel_fraction=0.0, shared_prefix=None, **top):
    synthetic = {"num_requests": num_requests, "arrival": {"process": "poisson", "rate": rate},
                 "prompt_tokens": {"dist": "lognormal", "mean": 800, "sigma": 0.8},
                 "output_tokens": {"dist": "lognormal", "mean": 120, "sigma": 0.8},
                 "cancel_fraction": cancel_fraction}
    if shared_prefix:
        synthetic["shared_prefix"] = shared_prefix
    raw = {"name": "fleet", "model": "llama-3.1-8b", "gpu": "h200", "seed": 3,
           "cache": {"block_size": 16, "prefix_sharing_scope": "global"},
           "workload": {"synthetic": synthetic}, "slo": {"ttft_s": 1.0, "tpot_s": 0.1}}
    raw.update(top)
    return raw


def cluster(replicas=1, policy="round_robin", **router):
    return {"pools": [{"name": "main", "replicas": replicas}],
            "router": {"policy": policy, **router}}


def plain_keys(summary):
    return {k: v for k, v in summary.items() if k not in FLEET_ONLY and k != "wall_time_s"}


@pytest.mark.parametrize("policy", ["round_robin", "kv_aware"])
def test_a_one_replica_cluster_gives_the_plain_runs_results(policy):
    raw = scenario(cancel_fraction=0.1)
    plain = simulate(load_scenario(raw))
    fleet = simulate(load_scenario({**raw, "cluster": cluster(1, policy)}))
    assert list(plain_keys(fleet.summary)) == list(plain_keys(plain.summary))
    assert plain_keys(fleet.summary) == plain_keys(plain.summary)
    assert set(fleet.summary) - set(plain.summary) == {"pools", "replicas", "router"}
    assert (fleet.requests["replica"] == "main-0").all()
    assert csv_text(fleet.requests.drop(columns=["replica"])) == csv_text(plain.requests)
    assert csv_text(fleet.steps.drop(columns=["replica"])) == csv_text(plain.steps)
    (replica,) = fleet.summary["replicas"]
    assert replica["name"] == "main-0" and replica["requests_total"] == 150


@pytest.mark.parametrize("policy", ["round_robin", "random"])
def test_round_robin_replicas_are_separate_runs_of_their_requests(policy):
    raw = {**scenario(num_requests=240, rate=60.0, cancel_fraction=0.1),
           "cluster": cluster(3, policy)}
    scn = load_scenario(raw)
    fleet = simulate(scn)
    frame = load_requests_frame(scn)
    picks = np.array(assign(policy, frame["arrival_s"].tolist(), 3, scn.seed))
    if policy == "round_robin":
        assert picks.tolist() == [i % 3 for i in range(len(frame))]
    separate = []
    for i in range(3):
        part = frame[picks == i].reset_index(drop=True)
        run = simulate(scn.cluster.pools[0].scenario, trace_df=part)
        separate.append(run)
        row = {k: v for k, v in fleet.summary["replicas"][i].items()
               if k not in ("name", "pool", "role", "gpu")}
        # the notes about the input (requests_dropped, warnings) are the fleet's, not a replica's
        assert row == {k: v for k, v in run.summary.items()
                       if k not in ("wall_time_s", "requests_dropped", "warnings")}
        mine = fleet.requests[fleet.requests["replica"] == f"main-{i}"]
        assert csv_text(mine.drop(columns=["replica"]).reset_index(drop=True)) == \
            csv_text(run.requests)
        steps = fleet.steps[fleet.steps["replica"] == f"main-{i}"]
        assert csv_text(steps.drop(columns=["replica"]).reset_index(drop=True)) == \
            csv_text(run.steps)
    total = fleet.summary
    for key in ("requests_total", "requests_completed", "requests_cancelled", "num_blocks",
                "num_steps", "preemptions", "cached_tokens"):
        assert total[key] == sum(r.summary[key] for r in separate), key
    assert total["sim_duration_s"] == max(r.summary["sim_duration_s"] for r in separate)
    assert total["running_peak"] <= sum(r.summary["running_peak"] for r in separate)
    assert total["running_peak"] >= max(r.summary["running_peak"] for r in separate)
    used = sum(r.summary["kv_utilization_mean"] * r.summary["num_blocks"] *
               r.steps["duration_s"].sum() for r in separate)
    busy = sum(r.summary["num_blocks"] * r.steps["duration_s"].sum() for r in separate)
    assert total["kv_utilization_mean"] == pytest.approx(used / busy, rel=1e-9)
    assert len(total["pools"]) == 1 and total["pools"][0]["requests_total"] == 240


TIGHT_SHARED = {"shared_prefix": {"num_groups": 12, "prefix_tokens": 3000, "fraction": 1.0,
                                  "block_tokens": 16},
                "cache": {"block_size": 16, "prefix_sharing_scope": "global",
                          "num_gpu_blocks_override": 1500}}


@pytest.mark.parametrize("policy,refresh_s,tight", [
    ("least_requests", 0, False), ("least_kv", 0, False), ("least_kv", 0.05, False),
    ("prefix_affinity", 0, False), ("kv_aware", 0, False), ("kv_aware", 0, True),
    ("least_kv", 0, True)])
def test_a_state_dependent_router_gives_the_step_by_step_results(policy, refresh_s, tight,
                                                                  monkeypatch):
    """Decode runs cut at routed arrivals give the steps one by one, byte for byte; `tight`:
    shared prefixes in a small pool, where runs evict cached blocks a router's lookup sees."""
    raw = {**scenario(num_requests=200, rate=20.0, cancel_fraction=0.1,
                      shared_prefix=TIGHT_SHARED["shared_prefix"] if tight else None),
           "cluster": cluster(3, policy, refresh_s=refresh_s)}
    if tight:
        raw["cache"] = TIGHT_SHARED["cache"]
        raw["scheduler"] = {"max_model_len": 8192}
    scn = load_scenario(raw)
    runs = []
    commit = DecodeRun.commit
    monkeypatch.setattr(DecodeRun, "commit",
                        lambda self, ends, rec: (runs.append(len(ends) - 1),
                                                 commit(self, ends, rec)))
    cuts = []
    cut_run = CostModelExecutor.cut_run
    monkeypatch.setattr(CostModelExecutor, "cut_run",
                        lambda self, *a: (cuts.append(1), cut_run(self, *a)))
    fast = simulate(scn)
    took = list(runs)
    exact = simulate(scn, exact=True)
    assert csv_text(fast.requests) == csv_text(exact.requests)
    assert csv_text(fast.steps) == csv_text(exact.steps)
    assert fast.summary["replicas"] == exact.summary["replicas"]
    # decode runs are kept, cut where an arrival is routed inside one
    assert sum(took) > 0.2 * len(fast.steps), sum(took)
    assert len(cuts) > 10, len(cuts)
    assert len(runs) == len(took)          # the exact run takes none


def test_least_requests_spreads_requests_more_evenly_than_random():
    raw = scenario(num_requests=300, rate=80.0)
    counts = {}
    for policy in ("random", "least_requests"):
        res = simulate(load_scenario({**raw, "cluster": cluster(4, policy)}))
        counts[policy] = res.summary["router"]["requests_imbalance"]
        assert res.summary["leaked_blocks"] == 0
    assert counts["least_requests"] < counts["random"]


@pytest.mark.parametrize("policy", ["prefix_affinity", "kv_aware"])
def test_prefix_aware_routing_raises_the_hit_ratio_on_shared_prefixes(policy):
    shared = {"num_groups": 12, "prefix_tokens": 3000, "fraction": 1.0, "block_tokens": 16}
    raw = scenario(num_requests=240, rate=20.0, shared_prefix=shared)
    ratio = {}
    for p in ("round_robin", policy):
        res = simulate(load_scenario({**raw, "cluster": cluster(4, p)}))
        ratio[p] = res.summary["router"]["prefix_cache_hit_ratio"]
    assert ratio[policy] > ratio["round_robin"]


def test_pools_are_addressed_by_index_in_set():
    raw = {**scenario(num_requests=40), "cluster": {"pools": [
        {"name": "a", "replicas": 1}, {"name": "b", "replicas": 1, "gpu": "h100"}]}}
    scn = load_scenario(raw, {"cluster.pools.1.replicas": "3",
                              "cluster.pools.0.cache.block_size": "32"})
    assert [p.replicas for p in scn.cluster.pools] == [1, 3]
    assert scn.cluster.pools[0].scenario.cache.block_size == 32
    assert scn.cluster.pools[1].scenario.cache.block_size == 16
    assert scn.cluster.pools[1].scenario.gpu.name == "h100"
    res = simulate(scn)
    assert [r["name"] for r in res.summary["replicas"]] == ["a-0", "b-0", "b-1", "b-2"]
    assert res.summary["block_size"] is None       # pools differ
    assert res.summary["num_blocks"] == sum(r["num_blocks"] for r in res.summary["replicas"])


def pd_scenario(link=None, rate=20.0, **extra):
    raw = scenario(num_requests=120, rate=rate)
    raw["cluster"] = {"pools": [{"name": "p", "replicas": 1, "role": "prefill"},
                                {"name": "d", "replicas": 2, "role": "decode"}],
                      "router": {"policy": "least_requests"},
                      "kv_transfer": link or {"link": "ib-ndr"}, **extra}
    return raw


def test_prefill_decode_hands_each_prompt_over_the_link():
    scn = load_scenario(pd_scenario())
    res = simulate(scn)
    req = res.requests
    assert (req["status"] == "completed").all()
    assert set(req["prefill_replica"]) == {"p-0"} and set(req["decode_replica"]) <= {"d-0", "d-1"}
    link = scn.cluster.kv_transfer
    bytes_per_block = 2 * 32 * 8 * 128 * 2 * 16          # llama-3.1-8b, bf16, 16-token blocks
    blocks = -(-req["prompt_tokens"] // 16)
    assert np.allclose(req["kv_transfer_s"],
                       link.latency_s + blocks * bytes_per_block / link.bandwidth_bytes_per_s)
    assert (req["ttft_s"] > req["kv_transfer_s"]).all()
    assert res.summary["leaked_blocks"] == 0
    assert res.summary["kv_transfer"]["transfers"] == 120
    roles = {r["name"]: r for r in res.summary["replicas"]}
    assert roles["p-0"]["requests_total"] == 120      # every prompt prefilled there
    assert roles["d-0"]["requests_total"] + roles["d-1"]["requests_total"] == 120


def test_a_slower_link_raises_ttft_under_prefill_decode():
    fast = simulate(load_scenario(pd_scenario({"link": "nvlink"})))
    slow = simulate(load_scenario(pd_scenario({"bandwidth_gbps": 1.0, "latency_s": 0.001})))
    assert slow.summary["ttft_s"]["mean"] > fast.summary["ttft_s"]["mean"]
    assert (slow.requests["kv_transfer_s"] > fast.requests["kv_transfer_s"]).all()


def test_prefill_waits_for_decode_room_and_nothing_leaks():
    # decode pools of 600 blocks: prompts wait on the prefill replica for room (backpressure)
    raw = pd_scenario(rate=200.0)
    raw["scheduler"] = {"max_model_len": 6000}
    raw["cluster"]["pools"][1]["cache"] = {"num_gpu_blocks_override": 600}
    raw["cluster"]["pools"][0]["cache"] = {"num_gpu_blocks_override": 400}
    res = simulate(load_scenario(raw), check_integrity=True)
    assert res.summary["kv_transfer"]["handoff_wait_s"]["p99"] > 0
    assert res.summary["leaked_blocks"] == 0
    assert (res.requests["status"] == "completed").all()


BAD = [
    ({"pools": [{"name": "a", "replicas": 0}]}, "cluster.pools.0.replicas"),
    ({"pools": [{"name": "d", "replicas": 1, "role": "decode"}]}, "no prefill pool"),
    ({"pools": [{"name": "a", "replicas": 1}], "router": {"policy": "fastest"}},
     "cluster.router.policy"),
    ({"pools": [{"name": "p", "replicas": 1, "role": "prefill"},
                {"name": "d", "replicas": 1, "role": "decode"}],
      "kv_transfer": {"latency_s": 0.001}}, "cluster.kv_transfer.bandwidth_gbps"),
    ({"pools": [{"name": "a", "replicas": 1}, {"name": "small", "replicas": 1,
                                                "gpu": "l40s", "model": "llama-3.1-70b"}]},
     "cluster.pools.1"),
    ({"pools": [{"name": "a", "replicas": 1, "replica": 2}]}, "cluster.pools.0.replica"),
]


@pytest.mark.parametrize("section,named", BAD)
def test_bad_cluster_input_is_one_error_line_and_exit_2(tmp_path, capsys, section, named):
    path = write(tmp_path / "bad.yaml", {**scenario(num_requests=5), "cluster": section})
    assert run_cli(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert named in err


def test_set_of_a_pool_that_is_not_there_is_an_error():
    with pytest.raises(InputError, match=r"cluster\.pools\.4: no such entry"):
        load_scenario({**scenario(), "cluster": cluster(2)}, {"cluster.pools.4.replicas": "1"})


def test_run_writes_the_replica_column_and_prints_a_replica_table(tmp_path, capsys):
    path = write(tmp_path / "f.yaml", {**scenario(num_requests=60), "cluster": cluster(2)})
    out = tmp_path / "out"
    assert run_cli(["run", str(path), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "main-0" in text and "main-1" in text
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary["replicas"]] == ["main-0", "main-1"]
    assert "replica" in (out / "requests.csv").read_text().splitlines()[0].split(",")


def fleet_scenario_file(tmp_path, **cluster_section):
    raw = scenario(num_requests=120, rate=10.0)
    raw["slo"] = {"ttft_p90_s": 0.5, "tpot_p90_s": 0.03}
    raw["cluster"] = cluster_section or cluster(1)
    return write(tmp_path / "fleet.yaml", raw)


def test_fleet_finds_the_smallest_passing_fleet_and_one_fewer_fails(tmp_path, capsys):
    path = fleet_scenario_file(tmp_path)
    assert run_cli(["fleet", str(path), "--rate", "60", "--json",
                    "--gpu-price", "h200=2.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    n = out["replicas"]
    assert n > 1 and out["pools"] == {"main": n} and out["gpus"] == n
    assert out["cost_per_hour_usd"] == pytest.approx(2.5 * n)
    assert out["largest_failing"]["replicas"] == n - 1 and out["largest_failing"]["reason"]
    from simkv.whatif.capacity import judge_slo
    scn = load_scenario(path, {"workload.time_scale": out["rate_scale"]})
    for count, met in ((n, True), (n - 1, False)):
        res = simulate(load_scenario(path, {"workload.time_scale": out["rate_scale"],
                                            "cluster.pools.0.replicas": count}))
        assert judge_slo(res.summary, res.requests, scn.slo).met is met
    tokens = out["at_answer"]["throughput_output_tokens_per_s"]
    assert out["cost_per_million_output_tokens_usd"] == pytest.approx(
        2.5 * n / (tokens * 3600) * 1e6)


def test_fleet_without_a_cluster_or_a_price_is_an_error(tmp_path, capsys):
    path = write(tmp_path / "plain.yaml", scenario(num_requests=20))
    assert run_cli(["fleet", str(path), "--rate", "5"]) == 2
    assert "cluster" in capsys.readouterr().err
    path = fleet_scenario_file(tmp_path, pools=[{"name": "l", "replicas": 1, "gpu": "l40s"}])
    assert run_cli(["fleet", str(path), "--rate", "5"]) == 2
    assert "--gpu-price l40s=" in capsys.readouterr().err


def test_capacity_of_a_cluster_grows_with_its_replicas():
    from simkv.whatif.capacity import find_capacity
    raw = scenario(num_requests=120, rate=10.0)
    raw["slo"] = {"ttft_p90_s": 0.5, "tpot_p90_s": 0.03}
    rates = [find_capacity(load_scenario({**raw, "cluster": cluster(n)}), tolerance=0.05)
             .max_rate_rps for n in (1, 2)]
    assert rates[1] > 1.5 * rates[0]


def test_a_lookup_inside_a_run_sees_the_blocks_its_started_steps_took():
    """kv_aware's lookup on a replica inside a decode run, with the cached blocks the run's
    started steps took counted as gone, equals a lookup after those blocks were taken."""
    import copy

    from simkv.engine.kv.hashing import hash_root
    from simkv.engine.request import Sequence
    from simkv.sim.cluster.router import _lookup_without, hashed_among_first_free
    from simkv.sim.engine import Simulation
    from simkv.workload.frames import requests_from_frame

    shared = {"num_groups": 3, "prefix_tokens": 480, "fraction": 1.0, "block_tokens": 16}
    raw = scenario(num_requests=60, rate=5.0, shared_prefix=shared)
    raw["cache"] = {"block_size": 16, "prefix_sharing_scope": "global",
                    "num_gpu_blocks_override": 400}
    raw["scheduler"] = {"max_model_len": 4096}
    scn = load_scenario(raw)
    sim = Simulation(scn)
    sim.run()
    kv = sim.scheduler.kv
    assert kv.pool.num_cached_free > 50          # finished requests' blocks, still hittable
    probes = requests_from_frame(load_requests_frame(scn))[:12]
    checked = 0
    for count in (1, 7, 40, 150, 399):
        evicted = hashed_among_first_free(kv.pool, count)
        after = copy.deepcopy(kv)
        after.pool.take(count)
        for req in probes:
            seq = Sequence(-1, req, 0, req.prompt_tokens)
            req.hash_root = hash_root(req, sim.scheduler.global_prefix_scope)
            _, tokens = after.prefix_lookup(Sequence(-1, req, 0, req.prompt_tokens))
            assert _lookup_without(kv, seq, evicted) == tokens
            checked += tokens > 0
    assert checked > 10
