"""Validation pipeline on CPU: the real engine (`tiny`, float64, reference attention) measures a
10-request trace, the simulator serves the same requests, and the comparison JSON is checked.

The trace lives in a temporary folder; measuring goes through the window that `prepare_window`
writes, with the trace itself moved away, as on the GPU machine that has no shared traces.
"""
import importlib.util
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from simkv.workload.traces import build_trace, write_canonical  # noqa: E402
from simkv.errors import InputError  # noqa: E402
from simkv.validate import (ERROR_KEYS, check_bounds, compare_validation,  # noqa: E402
                            load_validation_scenario, measure_validation, prepare_window,
                            relative_error, requests_fingerprint, validate_command)
from simkv.workload.frames import load_requests_frame  # noqa: E402

SCENARIO = """\
name: tiny-validation
model: tiny
gpu: h200
seed: 0
cache: {block_size: 4, num_gpu_blocks_override: 256, enable_prefix_caching: true}
scheduler: {max_num_seqs: 8, max_num_batched_tokens: 32, max_model_len: 64}
workload: {trace: trace.csv, format: csv, time_scale: 0.5, limit: 10}
"""


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def write_scenario(folder, scenario_text=SCENARIO):
    """12 requests over 0.44 s of trace time (10 are served); prompts 5-20, outputs 3-6."""
    prompts = [12, 5, 20, 9, 14, 7, 18, 11, 6, 16, 8, 10]
    outputs = [4, 3, 6, 5, 3, 4, 6, 3, 5, 4, 3, 3]
    columns = {"arrival_s": np.arange(12) * 0.04, "prompt_tokens": prompts,
               "output_tokens": outputs}
    write_canonical(build_trace(columns, source="test", format="csv"), folder / "trace.csv")
    path = folder / "scenario.yaml"
    path.write_text(scenario_text)
    return path


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """(scenario path, measurement folder): measured through the window, trace moved away."""
    folder = tmp_path_factory.mktemp("validate")
    path = write_scenario(folder)
    prepare_window(path, folder / "data")
    (folder / "trace.csv").rename(folder / "trace.away")
    out = measure_validation(path, folder / "measured", device="cpu", data_dir=folder / "data",
                             warmup_requests=2)
    (folder / "trace.away").rename(folder / "trace.csv")
    (out / "trace.csv").unlink()      # as committed: the comparison re-derives the window
    return path, out


def test_the_window_serves_the_same_requests_without_the_trace(tmp_path):
    path = write_scenario(tmp_path)
    before = load_requests_frame(load_validation_scenario(path))
    prepare_window(path, tmp_path / "data")
    (tmp_path / "trace.csv").unlink()
    after = load_requests_frame(load_validation_scenario(path, tmp_path / "data"))
    assert len(after) == 10
    assert after["arrival_s"].iloc[-1] == pytest.approx(9 * 0.04 * 0.5)
    assert requests_fingerprint(after) == requests_fingerprint(before)


def test_measuring_writes_both_runs_and_the_metadata(measured):
    _, out = measured
    meta = json.loads((out / "meta.json").read_text())
    assert meta["requests"] == 10 and meta["model"] == "tiny"
    for run in ("saturated", "realtime"):
        for name in ("summary.json", "requests.csv", "steps.csv", "ledger.json"):
            assert (out / run / name).is_file()
        summary = json.loads((out / run / "summary.json").read_text())
        assert summary["requests_completed"] == 10
    steps = (out / "realtime" / "steps.csv").read_text().splitlines()[0].split(",")
    assert {"span_s", "prep_s", "gpu_s", "host_s"} <= set(steps)


def test_comparing_writes_a_well_formed_json_with_finite_errors(measured, tmp_path):
    path, out = measured
    result = compare_validation(out, load_validation_scenario(path), tmp_path / "v.json")
    written = json.loads((tmp_path / "v.json").read_text())
    assert written["model"] == "tiny" and written["gpu"] == "h200"
    assert set(written["error"]) == set(ERROR_KEYS)
    assert all(math.isfinite(v) for v in written["error"].values())
    assert written["load"] > 0 and math.isfinite(written["load"])
    assert written["measured"]["requests_completed"] == written["simulated"]["requests_completed"]
    assert written["steps"]["realtime"]["matched_steps"] >= 1
    for name in result["plots"]:
        assert 0 < (tmp_path / name).stat().st_size <= 100_000


def test_compare_takes_another_cost_model_only_into_a_file_of_its_own(measured, tmp_path,
                                                                      capsys):
    from simkv.validate import main
    path, out = measured
    with pytest.raises(SystemExit) as e:
        main(["compare", str(path), "--measured", str(out), "--cost-model", "roofline"])
    assert e.value.code == 2 and "--cost-model needs --out" in capsys.readouterr().err
    assert main(["compare", str(path), "--measured", str(out), "--cost-model", "roofline",
                 "--out", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["cost_model"].startswith("roofline")


def test_compare_with_the_clock_fixed_simulates_the_scenario_so(measured, tmp_path, monkeypatch,
                                                                capsys):
    from simkv import validate
    path, out = measured
    with pytest.raises(SystemExit) as e:
        validate.main(["compare", str(path), "--measured", str(out), "--gpu-clock", "fixed"])
    assert e.value.code == 2 and "--gpu-clock needs --out" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(validate, "compare_validation",
                        lambda measured_dir, scn, out, **kw: seen.append(scn) or {})
    monkeypatch.setattr(validate, "format_table", lambda results: "")
    assert validate.main(["compare", str(path), "--measured", str(out), "--gpu-clock", "fixed",
                          "--out", str(tmp_path / "f.json")]) == 0
    assert seen[0].gpu_clock == "fixed"


def test_the_served_step_error_weighs_each_step_kind_by_its_time(tmp_path, capsys):
    from simkv.validation.diagnostics import main, served_step_error
    steps = {"steps": 10, "matched_steps": 10,
             "decode_graph": {"time_fraction": 0.75, "error_vs_duration_total": -0.04},
             "eager": {"time_fraction": 0.25, "error_vs_duration_total": 0.08},
             # a part of decode_graph, reported apart: not counted again
             "decode_graph_over_128_decodes": {"time_fraction": 0.5,
                                               "error_vs_duration_total": 0.5}}
    result = {"cost_model": "m", "steps": {"realtime": steps}}
    assert served_step_error(result) == pytest.approx(0.05)
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert main([str(tmp_path / "r.json")]) == 0
    assert "5.00%\t(10 of 10 steps matched)" in capsys.readouterr().out
    for bad in ({}, {"steps": None}, {"steps": {"realtime": []}},
                {"steps": {"realtime": dict(steps, matched_steps=0)}},
                {"steps": {"realtime": dict(steps, eager={"time_fraction": 0.25})}}):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        assert main([str(tmp_path / "bad.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / 'bad.json'}: ") and err.count("\n") == 1


def test_the_step_diagnostic_splits_a_prediction_into_forward_and_around(measured):
    from simkv.validation.data import read_run
    from simkv.validation.diagnostics import step_diagnostics

    class Fixed:                       # 10 ms a step, 2 ms of it the engine's host time
        name = "fixed"

        def predict(self, plan):
            return 0.010

        def host_seconds(self, plan):
            return 0.002

    path, out = measured
    scn = load_validation_scenario(path)
    run = read_run(out / "realtime")
    diag = step_diagnostics(scn, load_requests_frame(scn), run, Fixed())
    kinds = [kind for kind in ("decode_graph", "mixed_graph", "eager") if kind in diag]
    assert kinds
    for kind in kinds:
        entry = diag[kind]
        assert entry["predicted_host_ms_mean"] == pytest.approx(2.0)
        span_ms = entry["span_ms_mean"]
        assert entry["forward_error_vs_span_total"] == pytest.approx(8.0 / span_ms - 1)


def test_calibrating_on_the_saturated_run_makes_its_simulated_duration_the_measured_one(
        measured, tmp_path):
    path, out = measured
    plain = compare_validation(out, load_validation_scenario(path), tmp_path / "p.json",
                               plots=False, diagnostics=False)
    assert plain["calibration"] is None
    result = compare_validation(out, load_validation_scenario(path), tmp_path / "c.json",
                                plots=False, diagnostics=False, calibrate=True)
    calibration = result["calibration"]
    assert calibration["step_time_scale"] == pytest.approx(
        calibration["saturated_measured_s"] / calibration["saturated_simulated_s"], rel=1e-3)
    # all requests at t = 0: step times scaled by s, the run lasts s times as long
    assert result["saturated"]["error"]["sim_duration_s"] == pytest.approx(0.0, abs=1e-9)
    assert plain["saturated"]["error"]["sim_duration_s"] != pytest.approx(0.0, abs=1e-3)
    assert result["cost_model"].endswith(f"*{calibration['step_time_scale']:g}")


def test_comparing_refuses_requests_other_than_those_measured(measured):
    path, out = measured
    from simkv.config.scenario import load_scenario
    faster = load_scenario(path, overrides={"workload.time_scale": 0.25})
    with pytest.raises(InputError, match="differ from those measured"):
        compare_validation(out, faster, plots=False)


def test_without_simpy_the_command_measures_only(tmp_path, monkeypatch, capsys):
    path = write_scenario(tmp_path, SCENARIO.replace("limit: 10", "limit: 3"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "simpy" else real(name, *a))
    assert validate_command(path, "cpu", tmp_path / "out") == 0
    assert "simpy is not installed here" in capsys.readouterr().out
    assert (tmp_path / "out" / "tiny-validation" / "meta.json").is_file()
    assert not (tmp_path / "out" / "tiny-validation.json").exists()


def test_relative_error_is_zero_for_two_zeros_and_undefined_over_zero():
    assert relative_error(110, 100) == pytest.approx(0.10)
    assert relative_error(0, 0) == 0.0
    assert relative_error(3, 0) is None
    assert relative_error(None, 1.0) is None


def test_the_engines_blocks_follow_the_pool_sizing_rule_of_simkv_size(tmp_path):
    # vLLM's rule leaves the CUDA-graph pool and the allocator's slack outside the budget, the
    # engine's keeps them inside: the measured memory gives the blocks under the scenario's rule
    from simkv.config.scenario import with_overrides
    from simkv.validate import ledger_num_blocks
    gib = 1 << 30
    ledger = {"device_memory_bytes": 100 * gib, "device_used_peak_bytes": 80 * gib,
              "kv_pool_bytes": 50 * gib, "graph_pool_bytes": 2 * gib,
              "unattributed_bytes": gib // 2}
    base = load_validation_scenario(write_scenario(tmp_path))
    scn = {rule: with_overrides(base, {"cache.pool_sizing": rule,
                                       "cache.gpu_memory_utilization": 0.9})
           for rule in ("engine", "vllm")}
    blocks = {rule: ledger_num_blocks(ledger, scn[rule], gib // 4) for rule in scn}
    assert blocks == {"engine": (90 - 30) * 4, "vllm": (90 - 30 + 2.5) * 4}
    # a negative residual (the parts over-count the peak) is no slack to give back
    assert ledger_num_blocks(dict(ledger, unattributed_bytes=-gib), scn["vllm"], gib // 4) \
        == (90 - 30 + 2) * 4


def test_bounds_tighten_at_low_load():
    error = {"ttft_s.mean": 0.10}
    assert not check_bounds(error, 0.6)["ttft_s.mean"]["ok"]      # 5% at load <= 0.7
    assert check_bounds(error, 0.9)["ttft_s.mean"]["ok"]          # 15% above


def test_the_command_measures_then_compares_into_one_folder(tmp_path, capsys):
    path = write_scenario(tmp_path, SCENARIO.replace("limit: 10", "limit: 3"))
    assert validate_command(path, "cpu", tmp_path / "out") == 0
    assert (tmp_path / "out" / "tiny-validation" / "realtime" / "summary.json").is_file()
    written = json.loads((tmp_path / "out" / "tiny-validation.json").read_text())
    assert written["requests"] == 3
    assert "| tiny-validation |" in capsys.readouterr().out


def test_the_comparison_simulates_the_pool_the_engine_served(measured, tmp_path):
    # without an override, `simkv size` gives this scenario a far larger pool than the 256
    # blocks the engine served; the simulator serves those 256 (num_blocks compares the sizing)
    path, out = measured
    sized = write_scenario(tmp_path, SCENARIO.replace(" num_gpu_blocks_override: 256,", ""))
    result = compare_validation(out, load_validation_scenario(sized), tmp_path / "v.json")
    assert result["simulated"]["num_blocks"] == result["measured"]["num_blocks"] == 256
    assert result["error"]["num_blocks"] > 1.0


def test_the_decode_time_split_takes_the_preparation_out_of_the_span(tmp_path, capsys):
    import pandas as pd
    from simkv.validation.diagnostics import decode_time_split, main
    steps = pd.DataFrame({"num_prefill_tokens": [0, 0, 512],
                          "duration_s": [0.010, 0.012, 0.030],
                          "span_s": [0.009, 0.011, 0.029],
                          "prep_s": [0.0005, 0.0007, 0.002],
                          "num_seqs": [10, 12, 3]})
    split = decode_time_split(steps)       # the step with a prefill chunk is left out
    assert split == {"steps": 2, "num_seqs_mean": 11.0, "duration_ms": 11.0, "gpu_ms": 9.4,
                     "prep_ms": 0.6, "outside_ms": 1.0}
    run = tmp_path / "measured" / "realtime"
    run.mkdir(parents=True)
    steps.to_csv(run / "steps.csv", index=False)
    (tmp_path / "r.json").write_text(json.dumps({"measured_dir": str(tmp_path / "measured")}))
    assert main(["--split", str(tmp_path / "r.json")]) == 0
    assert "\t2\t11.0\t11.000\t9.400\t0.600\t1.000" in capsys.readouterr().out
    # a run without the executor's columns or with a non-number in them, or no run where the
    # result says: one line, exit 2
    steps.assign(prep_s=["x", 0.1, 0.2]).to_csv(run.parent / "bad.csv", index=False)
    with pytest.raises(InputError, match="column 'prep_s'"):
        decode_time_split(pd.read_csv(run.parent / "bad.csv"))
    steps.drop(columns="prep_s").to_csv(run / "steps.csv", index=False)
    (tmp_path / "gone.json").write_text(json.dumps({"measured_dir": str(tmp_path / "nowhere")}))
    for bad in ("r.json", "gone.json"):
        assert main(["--split", str(tmp_path / bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1


def test_a_comparison_simulates_under_the_rules_the_measurement_ran_under(measured, tmp_path):
    """meta.json records the semantics (simkv.semantics); a measurement from before it
    did ran under vllm-0.18 (simkv's engine) or vllm-0.26 (vLLM v0.26 itself)."""
    from simkv.validation.compare import measured_semantics
    path, out = measured
    meta = json.loads((out / "meta.json").read_text())
    assert meta["semantics"] == "vllm-0.26"
    old = tmp_path / "old"
    import shutil
    shutil.copytree(out, old)
    del meta["semantics"]
    (old / "meta.json").write_text(json.dumps(meta))
    result = compare_validation(old, load_validation_scenario(path), tmp_path / "v.json",
                                plots=False, diagnostics=False)
    assert result["semantics"] == "vllm-0.18"
    assert measured_semantics({"engine": {"name": "vllm", "vllm": "0.26.0"}}) == "vllm-0.26"
    assert measured_semantics({"engine": {"name": "simkv"}}) == "vllm-0.18"
    assert result["async_scheduling"] is False


def test_a_vllm_measurement_is_simulated_with_asynchronous_scheduling():
    """vLLM v0.26 schedules asynchronously unless its engine arguments say otherwise
    (vllm/config/vllm.py: async_scheduling None resolves to true); simkv's engine never does."""
    from simkv.validation.compare import measured_async
    vllm = {"name": "vllm", "vllm": "0.26.0", "engine_kwargs": {"max_num_seqs": 256}}
    assert measured_async({"engine": vllm}) is True
    off = {**vllm, "engine_kwargs": {"async_scheduling": False}}
    assert measured_async({"engine": off}) is False
    assert measured_async({"engine": {"name": "simkv"}}) is False


def test_the_command_measures_and_compares_a_gemma_3_model(tmp_path, capsys):
    # Gemma 3's layers and KV cache groups (a 16-token window on two of three layers) through
    # the measurement's engine and the comparison; the engine holds the vision tower's bytes
    from pathlib import Path

    from simkv.specs import load_model
    config = Path(__file__).parent / "data" / "tiny-gemma3.json"
    text = SCENARIO.replace("model: tiny", f"model: {config}").replace("limit: 10", "limit: 4")
    path = write_scenario(tmp_path, text)
    assert validate_command(path, "cpu", tmp_path / "out") == 0
    folder = tmp_path / "out" / "tiny-validation"
    for run in ("saturated", "realtime"):
        summary = json.loads((folder / run / "summary.json").read_text())
        assert summary["requests_completed"] == 4
        assert [g["attention_type"] for g in summary["kv_groups"]] == ["sliding", "sliding",
                                                                       "full"]
        ledger = json.loads((folder / run / "ledger.json").read_text())
        assert ledger["weights_bytes"] == 4 * load_model(str(config)).weight_bytes()  # float64
    written = json.loads((tmp_path / "out" / "tiny-validation.json").read_text())
    assert written["requests"] == 4 and written["model"] == "tiny-gemma3"
