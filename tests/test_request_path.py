"""The request path (docs/semantics.md, "The request path"): `scheduler.admission_delay_s` (a
request becomes schedulable that long after its trace arrival), `scheduler.output_delay_s` and
`scheduler.output_delay_per_running_s` (a step's outputs reach the client that long after its
end, plus so much per request running in it). All 0 by default: the run is the same."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import simkv
from simkv.errors import InputError
from simkv.sim.engine import simulate
from simkv.validate import compare_needs_out
from tests.test_config import minimal

REPO = Path(__file__).resolve().parents[1]


def scenario(rate: float, n: int, **scheduler):
    return simkv.load_scenario(minimal(
        cost_model="roofline", seed=3,
        scheduler={"async_scheduling": True, **scheduler},
        workload={"synthetic": {"num_requests": n,
                                "arrival": {"process": "poisson", "rate": rate},
                                "prompt_tokens": {"dist": "uniform", "min": 64, "max": 900},
                                "output_tokens": {"dist": "uniform", "min": 2, "max": 40}}}))


def run(rate, n, **scheduler):
    result = simulate(scenario(rate, n, **scheduler))
    return result, result.requests.set_index("request_id"), result.steps


def test_defaults_change_nothing_and_say_nothing():
    base, req, steps = run(20.0, 30)
    zero, zreq, zsteps = run(20.0, 30, admission_delay_s=0.0, output_delay_s=0.0,
                             output_delay_per_running_s=0.0)
    assert "request_path" not in base.summary and "request_path" not in zero.summary
    assert req.to_csv() == zreq.to_csv() and steps.to_csv() == zsteps.to_csv()
    a, b = dict(base.summary), dict(zero.summary)
    a.pop("wall_time_s"), b.pop("wall_time_s")
    assert json.dumps(a) == json.dumps(b)


def test_an_isolated_request_waits_the_whole_path():
    # requests 20 s apart on average, each served long before the next one comes
    adm, out, per = 0.002, 0.0013, 0.0004
    _, req, steps = run(0.05, 6)
    _, dreq, dsteps = run(0.05, 6, admission_delay_s=adm, output_delay_s=out,
                          output_delay_per_running_s=per)
    assert (req["status"] == "completed").all()
    gaps = np.diff(req["arrival_s"].to_numpy())
    assert (gaps > 2 * req["e2e_s"].max()).all()            # isolated indeed
    # each request alone: its steps start `adm` later, take as long, and its first token
    # and finish reach the client out + per x 1 running after them
    assert np.allclose(dsteps["start_s"] - steps["start_s"], adm, atol=1e-9)
    assert np.allclose(dsteps["duration_s"], steps["duration_s"], atol=1e-12)
    assert np.allclose(dreq["ttft_s"] - req["ttft_s"], adm + out + per, atol=1e-9)
    assert np.allclose(dreq["e2e_s"] - req["e2e_s"], adm + out + per, atol=1e-9)
    assert np.allclose(dreq["tpot_s"], req["tpot_s"], atol=1e-12)


def test_the_output_delay_grows_with_the_requests_running_in_the_step():
    out, per = 0.001, 0.0002
    _, req, steps = run(40.0, 60)
    res, dreq, dsteps = run(40.0, 60, output_delay_s=out, output_delay_per_running_s=per)
    assert steps.to_csv() == dsteps.to_csv()                  # the engine's clock is untouched
    assert res.summary["request_path"] == {"admission_delay_s": 0.0, "output_delay_s": out,
                                           "output_delay_per_running_s": per}
    ends = (steps["start_s"] + steps["duration_s"]).to_numpy()
    done = req["status"] == "completed"
    running = []
    for t in req.loc[done, "first_token_s"]:
        k = int(np.argmin(np.abs(ends - t)))
        assert abs(ends[k] - t) < 1e-9
        running.append(steps["num_running"].iloc[k])
    running = np.asarray(running, dtype=float)
    assert running.max() >= 4                                 # batches, not a constant
    shift = (dreq.loc[done, "first_token_s"] - req.loc[done, "first_token_s"]).to_numpy()
    assert np.allclose(shift, out + per * running, atol=1e-9)
    assert res.summary["ttft_s"]["mean"] > simulate(scenario(40.0, 60)).summary["ttft_s"]["mean"] \
        + out


def test_admission_moves_the_schedule_but_not_the_clock_of_ttft():
    # a busy engine: a later admission can only make the first token later, never earlier
    _, req, _ = run(40.0, 60)
    _, dreq, _ = run(40.0, 60, admission_delay_s=0.003)
    done = req["status"] == "completed"
    assert (dreq.loc[done, "arrival_s"] == req.loc[done, "arrival_s"]).all()
    assert (dreq.loc[done, "ttft_s"] >= req.loc[done, "ttft_s"] + 0.003 - 0.0105).all()
    assert dreq.loc[done, "ttft_s"].mean() > req.loc[done, "ttft_s"].mean() + 0.002


@pytest.mark.parametrize("key,value", [("admission_delay_s", -0.001), ("output_delay_s", 2.0),
                                       ("output_delay_per_running_s", float("nan"))])
def test_bad_delays_are_refused_by_name(key, value):
    with pytest.raises(InputError) as e:
        simkv.load_scenario(minimal(scheduler={key: value}))
    assert f"scheduler.{key}" in str(e.value)


def test_compare_overrides_need_out():
    assert "--set" in compare_needs_out(set_=["scheduler.output_delay_s=0.001"])
    assert compare_needs_out() is None


def _path_module():
    spec = importlib.util.spec_from_file_location(
        "vllm_path", REPO / "scripts" / "vllm_device" / "path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_output_path_is_measured_from_core_and_client_times():
    path = _path_module()
    rng = np.random.default_rng(0)
    steps = []
    for i in range(400):
        running = int(rng.integers(1, 65))
        core = 0.01 * i
        steps.append({"core_t_s": core, "t_s": core + 0.0007 + 0.00003 * running,
                      "num_running": running, "num_prefill_tokens": 0,
                      "num_decode_tokens": running})
    raw = {"phases": [{"arrivals_s": [], "steps": steps, "requests": [], "spec": ["mix", 0]}]}
    c0, c1, n = path.output_path(raw)
    assert n == 400 and c0 == pytest.approx(0.0007, abs=1e-9) \
        and c1 == pytest.approx(0.00003, rel=1e-6)


def test_a_fleet_and_the_real_engine_refuse_the_delays():
    from simkv.engine.request_path import refuse_request_path
    scn = simkv.load_scenario(REPO / "scenarios" / "fleet-azure-conv.yaml",
                              {"scheduler.output_delay_s": 0.001, "workload.limit": 20})
    with pytest.raises(InputError) as e:
        simulate(scn)
    assert "scheduler.output_delay_s" in str(e.value) and "fleet" in str(e.value)
    with pytest.raises(InputError) as e:
        refuse_request_path(scenario(1.0, 2, admission_delay_s=0.001), "the real engine")
    assert "scheduler.admission_delay_s" in str(e.value)
    refuse_request_path(scenario(1.0, 2), "the real engine")        # 0: nothing to refuse


def test_the_gpu_engine_checks_the_request_path_without_simpy(tmp_path):
    # the GPU machine has no SimPy: the real engine's refusal must not import the simulator
    pytest.importorskip("torch")
    import subprocess
    import sys
    code = """
import importlib.abc, sys
class NoSimpy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "simpy":
            raise ImportError("simpy is not installed here")
sys.meta_path.insert(0, NoSimpy())
import simkv
from simkv.errors import InputError
from simkv.gpu.engine import Engine
raw = {"name": "t", "model": "tiny", "cache": {"num_gpu_blocks_override": 64},
       "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 128,
                     "admission_delay_s": 0.001},
       "workload": {"synthetic": {"num_requests": 2}}}
try:
    Engine(simkv.load_scenario(raw), "cpu")
except InputError as e:
    print("refused:", e)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "refused: scheduler.admission_delay_s: the real engine" in done.stdout
