"""simkv in vLLM's names: `--export vllm` (vllm bench serve's keys and units), vLLM's kv dtype
names, the preemption key's home, one spelling per latency figure (docs/vllm-names.md)."""
import json

import numpy as np
import pandas as pd
import pytest

import simkv
from simkv.engine.vllm_bench import peak_concurrency, vllm_bench_result
from simkv.errors import InputError
from simkv.sim.engine import simulate
from simkv.sim.provenance import SWAP_CAVEAT
from simkv.whatif.checks import parse_expectation, summary_key
from tests.test_cli_commands import REPO, simkv as simkv_cli

QUICKSTART = REPO / "scenarios" / "quickstart.yaml"


def hand_run():
    """Three requests a reader can check: TTFT 0.1, 0.2, 0.3 s; one has a single output token."""
    requests = pd.DataFrame({
        "arrival_s": [0.0, 0.5, 1.0], "prompt_tokens": [100, 200, 300],
        "output_tokens": [3, 1, 5], "ttft_s": [0.1, 0.2, 0.3],
        "tpot_s": [0.05, np.nan, 0.025], "e2e_s": [0.2, 0.2, 0.4],
        "finish_s": [0.2, 0.7, 1.4], "status": ["completed"] * 3})
    summary = {"sim_duration_s": 2.0, "requests_total": 4, "requests_cancelled": 1,
               "requests_rejected": 0, "throughput_output_tokens_per_s": 9 / 2.0,
               "goodput_requests_per_s": 1.0}
    return summary, requests, [0.05, 0.05, 0.025, 0.025, 0.025, 0.025]


def test_the_export_uses_vllm_bench_serves_names_units_and_definitions():
    summary, requests, itl = hand_run()
    r = vllm_bench_result(summary, requests, itl, percentiles=(50, 99))
    assert (r["duration"], r["completed"], r["failed"], r["num_prompts"]) == (2.0, 3, 1, 4)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (600, 9)
    assert r["request_throughput"] == 1.5 and r["output_throughput"] == 4.5
    assert r["total_token_throughput"] == 304.5 and r["request_goodput"] == 1.0
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["std_ttft_ms"] == pytest.approx(np.sqrt(2 / 3 * 0.01) * 1000)   # population std
    assert r["p99_ttft_ms"] == pytest.approx(298.0)                          # linear
    assert r["mean_tpot_ms"] == pytest.approx(37.5)      # the one-token request is left out
    assert r["mean_itl_ms"] == pytest.approx(1000 * 0.2 / 6)
    assert r["mean_e2el_ms"] == pytest.approx(800 / 3)
    assert "p90_ttft_ms" not in r and "p50_itl_ms" in r


def test_peak_concurrency_counts_half_open_intervals():
    assert peak_concurrency([0.0, 1.0], [1.0, 2.0]) == 1       # one leaves as the next comes
    assert peak_concurrency([0.0, 0.5, 0.7], [2.0, 1.0, 3.0]) == 3
    assert peak_concurrency([], []) == 0


def test_run_export_vllm_writes_vllm_bench_json_beside_the_results(tmp_path):
    done = simkv_cli("run", QUICKSTART, "--set", "workload.synthetic.num_requests=40",
                     "--export", "vllm", "--out", tmp_path)
    assert done.returncode == 0, done.stderr
    bench = json.loads((tmp_path / "vllm_bench.json").read_text())
    summary = json.loads((tmp_path / "summary.json").read_text())
    for name, family in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("itl", "itl_s"),
                         ("e2el", "e2e_s")):
        assert bench[f"mean_{name}_ms"] == pytest.approx(summary[family]["mean"] * 1000)
        assert bench[f"median_{name}_ms"] == pytest.approx(summary[family]["p50"] * 1000)
        assert bench[f"p99_{name}_ms"] == pytest.approx(summary[family]["p99"] * 1000)
    assert bench["request_throughput"] == pytest.approx(summary["throughput_requests_per_s"])
    assert bench["request_goodput"] == pytest.approx(summary["goodput_requests_per_s"])
    assert bench["completed"] == summary["requests_completed"] == 40


def test_an_unknown_export_is_bad_input(tmp_path):
    done = simkv_cli("run", QUICKSTART, "--export", "csv", "--out", tmp_path)
    assert done.returncode == 2 and done.stderr == "error: --export: 'csv' is not one of vllm\n"


@pytest.mark.parametrize("vllm_name,simkv_name", [("fp8_e4m3", "fp8"), ("fp8_e5m2", "fp8"),
                                                  ("auto", "bf16"), ("bfloat16", "bf16")])
def test_vllms_kv_dtype_names_are_the_same_caches(vllm_name, simkv_name):
    scn = simkv.load_scenario(QUICKSTART, {"cache.kv_dtype": vllm_name})
    assert scn.cache.kv_dtype == simkv_name


def test_a_kv_dtype_of_neither_name_lists_both():
    with pytest.raises(InputError, match="not one of bf16, fp8 .or vLLM's auto, bfloat16, fp8_e4m3"):
        simkv.load_scenario(QUICKSTART, {"cache.kv_dtype": "int4"})


def test_size_takes_vllms_kv_dtype_name():
    auto = json.loads(simkv_cli("size", "--model", "llama-3.1-8b", "--kv-dtype", "auto",
                                "--json").stdout)
    e4m3 = json.loads(simkv_cli("size", "--model", "llama-3.1-8b", "--kv-dtype", "fp8_e4m3",
                                "--json").stdout)
    assert auto["kv_dtype"] == "bf16" and e4m3["kv_dtype"] == "fp8"
    assert auto["bytes_per_token"] == 2 * e4m3["bytes_per_token"]


def test_the_preemption_mode_under_scheduler_points_to_cache():
    with pytest.raises(InputError, match=r"did you mean cache\.preemption_mode\?"):
        simkv.load_scenario(QUICKSTART, {"scheduler.preemption_mode": "swap"})


def test_swap_says_vllm_v1_only_recomputes():
    scn = simkv.load_scenario(QUICKSTART, {"cache.preemption_mode": "swap",
                                           "workload.synthetic.num_requests": 5})
    assert SWAP_CAVEAT in simulate(scn).provenance["caveats"]
    assert "only recomputes" in SWAP_CAVEAT


def test_checks_take_the_slo_spelling_of_a_latency_figure():
    assert summary_key("ttft_p90_s") == "ttft_s.p90" and summary_key("tpot_mean_s") == "tpot_s.mean"
    assert summary_key("ttft_s.p90") == "ttft_s.p90" and summary_key("num_blocks") == "num_blocks"
    assert parse_expectation("e2e_p99_s", "<= 2", "here").key == "e2e_s.p99"
