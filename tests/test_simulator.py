"""End to end: `simkv run` and the Python API on the shared real traces and on synthetic traffic."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import simkv
from simkv.engine.metrics import LATENCY_KEYS, REQUEST_COLUMNS, STEP_COLUMNS
from simkv.workload.traces import load_trace, write_canonical
from simkv.sim.engine import simulate

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces"
AZURE = TRACES / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = TRACES / "mooncake-fast25" / "synthetic_trace.jsonl"
needs_azure = pytest.mark.skipif(not AZURE.exists(), reason=f"shared trace absent: {AZURE}")
needs_mooncake = pytest.mark.skipif(not MOONCAKE.exists(), reason=f"shared trace absent: {MOONCAKE}")

SUMMARY_KEYS = [
    "requests_total", "requests_completed", "requests_cancelled", "requests_rejected",
    "sim_duration_s", "wall_time_s", "throughput_requests_per_s", "throughput_output_tokens_per_s",
    "ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s", "goodput_requests_per_s", "num_blocks",
    "block_size", "kv_utilization_mean", "kv_utilization_peak", "internal_fragmentation_mean",
    "blocks_per_seq", "running_mean", "running_peak", "waiting_peak", "preemptions",
    "preemptions_per_s", "prefix_cache_hit_ratio", "swapped_out_blocks", "swapped_in_blocks",
    "leaked_blocks", "cost_model"]


def trace_scenario(trace, **cache):
    return {"name": "trace", "model": "llama-3.1-8b", "gpu": "h200",
            "cache": {"block_size": 16, **cache}, "workload": {"trace": str(trace)},
            "slo": {"ttft_s": 1.0, "tpot_s": 0.1}}


def assert_sane(summary):
    for key in SUMMARY_KEYS:
        assert key in summary, key
    for family in ("ttft_s", "tpot_s", "e2e_s"):
        f = summary[family]
        assert 0 < f["p50"] <= f["p90"] <= f["p99"], (family, f)
        assert f["mean"] > 0
    assert summary["leaked_blocks"] == 0


def run_cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "simkv.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd)


@needs_azure
def test_run_replays_the_whole_azure_conv_trace(tmp_path):
    scn = tmp_path / "azure.yaml"
    scn.write_text(json.dumps(trace_scenario(AZURE)))
    proc = run_cli("run", scn, "--out", tmp_path / "out", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["requests_total"] == 19366
    assert summary["requests_completed"] + summary["requests_rejected"] == 19366
    assert_sane(summary)
    import pandas as pd
    requests = pd.read_csv(tmp_path / "out" / "requests.csv")
    steps = pd.read_csv(tmp_path / "out" / "steps.csv")
    assert list(requests.columns) == REQUEST_COLUMNS + ["queue_s"]
    assert list(steps.columns) == STEP_COLUMNS
    assert len(steps) == summary["num_steps"]


@needs_mooncake
def test_mooncake_trace_with_prefix_caching_reports_hits():
    res = simulate(simkv.load_scenario(trace_scenario(MOONCAKE, enable_prefix_caching=True)))
    assert_sane(res.summary)
    assert 0 < res.summary["prefix_cache_hit_ratio"] < 1
    assert res.requests["cached_tokens"].sum() > 0


@needs_mooncake
def test_prefix_hits_approach_the_traces_reuse_when_the_cache_is_unbounded():
    # 64% of the trace's prompt blocks repeat an earlier prefix (traces/README.md); with a pool
    # large enough never to evict, the hit ratio at block 512 must come close to that.
    scn = trace_scenario(MOONCAKE, block_size=512, num_gpu_blocks_override=200_000)
    scn["workload"]["time_scale"] = 20
    res = simulate(simkv.load_scenario(scn))
    assert res.summary["prefix_cache_hit_ratio"] == pytest.approx(0.64, abs=0.02)


@pytest.mark.parametrize("trace,limit", [(AZURE, 3000), (MOONCAKE, 500)])
def test_converted_trace_simulates_like_the_original(tmp_path, trace, limit):
    if not trace.exists():
        pytest.skip(f"shared trace absent: {trace}")
    canonical = write_canonical(load_trace(trace, limit=limit), tmp_path / "canonical.csv")
    results = []
    for path in (trace, canonical):
        scn = trace_scenario(path)
        scn["workload"]["limit"] = limit
        summary = simulate(simkv.load_scenario(scn)).summary
        summary.pop("wall_time_s")
        results.append(summary)
    assert results[0] == results[1]


def test_python_api_and_overrides():
    scn = simkv.load_scenario(ROOT / "scenarios" / "quickstart.yaml",
                              overrides={"cache.block_size": 32, "workload.limit": 50})
    res = simkv.simulate(scn)
    assert res.summary["block_size"] == 32
    assert res.summary["requests_total"] == 50
    assert len(res.requests) == 50
    assert set(LATENCY_KEYS) <= set(res.summary)


@pytest.mark.parametrize("sampling", ["fork", "fanout"])
def test_cancellations_and_parallel_samples_end_cleanly(sampling):
    scn = simkv.load_scenario({
        "name": "mixed", "model": "llama-3.2-1b", "gpu": "h200",
        "cache": {"block_size": 16, "num_gpu_blocks_override": 400},
        "scheduler": {"max_model_len": 4096, "max_num_seqs": 64, "parallel_sampling": sampling},
        "workload": {"synthetic": {
            "num_requests": 300, "arrival": {"process": "gamma", "rate": 40, "cv": 3},
            "prompt_tokens": {"dist": "lognormal", "mean": 600, "sigma": 0.8, "max": 3000},
            "output_tokens": {"dist": "uniform", "min": 1, "max": 300},
            "n": {"dist": "uniform", "min": 1, "max": 3},
            "shared_prefix": {"num_groups": 3, "prefix_tokens": 256, "fraction": 0.5},
            "cancel_fraction": 0.2}}})
    res = simulate(scn, check_integrity=True)
    s = res.summary
    assert s["requests_completed"] + s["requests_cancelled"] + s["requests_rejected"] == 300
    assert s["requests_cancelled"] > 0
    if sampling == "fork":          # forks share a partial tail and copy it
        assert s["cow_copies"] > 0
    else:                           # children share the prompt through the prefix cache only
        assert s["cow_copies"] == 0 and s["cached_tokens"] > 0
    assert (res.requests["output_tokens"] > 0).any() and s["leaked_blocks"] == 0


def test_run_writes_results_and_reports_bad_override(tmp_path):
    proc = run_cli("run", "scenarios/quickstart.yaml", "--set", "workload.limit=20",
                   "--out", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["requests_total"] == 20
    assert {p.name for p in tmp_path.iterdir()} >= {"summary.json", "requests.csv", "steps.csv"}
    bad = run_cli("run", "scenarios/quickstart.yaml", "--set", "cache.block_sise=32")
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: ") and "block_size" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_the_run_ends_when_the_last_request_is_final_not_at_a_later_cancellation_timer():
    from simkv.workload.frames import load_requests_frame
    scn = simkv.load_scenario(ROOT / "scenarios" / "quickstart.yaml",
                              overrides={"workload.limit": 5})
    frame = load_requests_frame(scn)
    frame["cancel_after_s"] = 1000.0          # long after every request has finished
    res = simulate(scn, trace_df=frame)
    assert res.summary["requests_completed"] == 5
    last_step_end = float((res.steps["start_s"] + res.steps["duration_s"]).max())
    assert res.summary["sim_duration_s"] == pytest.approx(last_step_end)
