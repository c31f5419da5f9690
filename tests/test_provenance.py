"""summary.json says where its numbers come from (provenance) and nothing about when or where it
ran (run.json); default results folders never mix settings; caveats reach the terminal."""
import hashlib
import json
import shutil

import pandas as pd
import pytest

import simkv
from simkv.sim.engine import simulate
from simkv.whatif.commands import mixed_cost_model_kinds
from tests.test_cli_commands import REPO, simkv as simkv_cli

QUICKSTART = REPO / "scenarios" / "quickstart.yaml"
SMALL = ["--set", "workload.synthetic.num_requests=20"]
PROVENANCE_KEYS = ["simkv_version", "model", "gpu", "settings", "trace", "trace_sha256", "seed",
                   "cost_model", "caveats"]


def run_json(tmp_path, *args, name="out"):
    """`simkv run quickstart (20 requests) ARGS --out tmp/NAME`: (summary dict, its text)."""
    out = tmp_path / name
    done = simkv_cli("run", QUICKSTART, *SMALL, *args, "--out", out)
    assert done.returncode == 0, done.stderr
    text = (out / "summary.json").read_text()
    return json.loads(text), text, done


def without_wall_time(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if '"wall_time_s"' not in line)


def test_the_provenance_names_version_model_gpu_settings_trace_seed_and_cost_model(tmp_path):
    summary, _, _ = run_json(tmp_path, "--set", "seed=3", "--set", "cache.block_size=32")
    prov = summary["provenance"]
    assert list(prov) == PROVENANCE_KEYS
    assert (prov["simkv_version"], prov["model"], prov["gpu"]) == (simkv.__version__,
                                                                     "llama-3.1-8b", "h200")
    assert prov["seed"] == 3 and prov["settings"]["seed"] == 3
    assert prov["settings"]["cache"]["block_size"] == 32         # after the overrides
    assert prov["settings"]["workload"]["synthetic"]["num_requests"] == 20
    assert prov["trace"] is None and prov["trace_sha256"] is None
    assert prov["cost_model"]["kind"] == "profile"
    assert prov["cost_model"]["source"] == "profiles/h200/llama-3.1-8b/fit.json"
    assert prov["caveats"] == []


def test_when_where_and_the_command_line_go_to_run_json_not_to_the_summary(tmp_path):
    summary, text, _ = run_json(tmp_path)
    for key in ("finished_utc", "host", "command", "cwd"):
        assert f'"{key}"' not in text
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert {"finished_utc", "host", "command", "cwd"} <= set(run)
    assert run["command"][:2] == ["simkv", "run"]


def test_running_the_same_input_again_changes_only_wall_time(tmp_path):
    _, first, _ = run_json(tmp_path, name="a")
    _, second, _ = run_json(tmp_path, name="b")
    assert without_wall_time(first) == without_wall_time(second)
    assert (tmp_path / "a" / "steps.csv").read_bytes() == (tmp_path / "b" / "steps.csv").read_bytes()


def test_output_options_are_not_settings(tmp_path):
    plain, _, _ = run_json(tmp_path, name="plain")
    other, _, _ = run_json(tmp_path, "--exact", "--json", "--step-terms", name="other")
    assert other["provenance"] == plain["provenance"]


def test_a_trace_run_records_the_trace_files_sha256(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,100,5\n0.5,200,3\n1.0,50,4\n")
    summary, _, _ = run_json(tmp_path, "--trace", trace, "--trace-format", "csv")
    prov = summary["provenance"]
    assert prov["trace"] == str(trace.resolve())
    assert prov["trace_sha256"] == hashlib.sha256(trace.read_bytes()).hexdigest()


def test_without_out_runs_of_different_settings_get_folders_of_their_own(tmp_path):
    def folder(*args):
        done = simkv_cli("run", QUICKSTART, *SMALL, *args, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return done.stdout.rsplit("results written to ", 1)[1].strip().rstrip("/")

    a, b, again = folder(), folder("--set", "cache.block_size=32"), folder()
    assert a != b and a == again
    assert a.startswith("results/quickstart-") and b.startswith("results/quickstart-")
    sizes = {json.loads((tmp_path / f / "summary.json").read_text())["block_size"] for f in (a, b)}
    assert sizes == {16, 32}


def test_requests_csv_has_each_requests_queueing_time(tmp_path):
    summary, _, _ = run_json(tmp_path)
    requests = pd.read_csv(tmp_path / "out" / "requests.csv")
    assert requests.columns[-1] == "queue_s"
    done = requests[requests["status"] == "completed"]
    assert done["queue_s"].mean() == pytest.approx(summary["queue_s"]["mean"], rel=1e-6)
    assert (done["queue_s"] >= 0).all() and (done["queue_s"] <= done["ttft_s"]).all()


def test_an_fp8_kv_cache_on_a_bf16_profile_is_a_caveat_on_the_terminal_too(tmp_path):
    summary, _, _ = run_json(tmp_path, "--set", "cache.kv_dtype=fp8", name="json")
    caveats = summary["provenance"]["caveats"]
    assert len(caveats) == 1 and "fp8" in caveats[0] and "not measured" in caveats[0]
    done = simkv_cli("run", QUICKSTART, *SMALL, "--set", "cache.kv_dtype=fp8",
                     "--out", tmp_path / "terminal")
    assert "caveat: kv_dtype fp8" in " ".join(done.stdout.split())


def test_an_interpolated_block_size_is_a_caveat(tmp_path):
    profile = tmp_path / "profile"
    shutil.copytree(REPO / "profiles" / "h200" / "llama-3.1-8b", profile,
                    ignore=shutil.ignore_patterns("repeat*", "validation", "vllm-*", "probes"))
    fit = json.loads((profile / "fit.json").read_text())
    fit["block_sizes"].remove(32)
    del fit["step"]["32"]
    (profile / "fit.json").write_text(json.dumps(fit))
    scn = simkv.load_scenario(QUICKSTART, {"cache.block_size": 32,
                                           "cost_model": str(profile / "fit.json"),
                                           "workload.synthetic.num_requests": 5})
    caveats = simulate(scn).provenance["caveats"]
    assert any("block size 32 not profiled" in c and "16 and 64" in c for c in caveats)


def test_a_gpu_without_a_profile_says_its_figures_are_a_roofline_estimate(tmp_path):
    summary, _, _ = run_json(tmp_path, "--set", "gpu=h100")
    prov = summary["provenance"]
    assert prov["gpu"] == "h100" and prov["cost_model"]["kind"] == "roofline"
    assert any("not comparable one for one" in c for c in prov["caveats"])


def test_a_sweep_across_cost_model_kinds_says_so():
    mixed = pd.DataFrame({"gpu": ["h200", "h100"],
                          "cost_model": ["profile:h200/llama-3.1-8b+clock", "roofline"]})
    one_kind = pd.DataFrame({"gpu": ["h200", "h100"], "cost_model": ["roofline", "roofline"]})
    assert "different kinds of cost model" in mixed_cost_model_kinds(mixed)
    assert mixed_cost_model_kinds(one_kind) is None


def test_a_fleets_provenance_holds_its_cluster_and_its_pools_cost_model():
    from simkv.config.scenario import load_scenario
    from tests.test_fleet import cluster, scenario
    raw = {**scenario(num_requests=20), "cluster": cluster(2)}
    result = simulate(load_scenario(raw))
    prov = result.provenance
    assert prov["settings"]["cluster"]["pools"][0]["replicas"] == 2
    assert prov["cost_model"]["kind"] == "profile" and prov["caveats"] == []
    assert "provenance" not in result.summary and result.summary_json()["provenance"] == prov


def test_a_fleets_requests_csv_has_queue_s_before_where_each_request_went(tmp_path):
    from simkv.config.scenario import load_scenario
    from tests.test_fleet import cluster, scenario
    result = simulate(load_scenario({**scenario(num_requests=20), "cluster": cluster(2)}))
    result.write(tmp_path)
    columns = list(pd.read_csv(tmp_path / "requests.csv").columns)
    assert columns[columns.index("queue_s") + 1] == "replica"
