"""Every tool a user runs is a `simkv` subcommand: each has --help, the GPU-side ones start
without simpy, and the cheap ones run end to end on CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from simkv.cli import run_cli

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "profiles" / "h200" / "llama-3.1-8b"
SUBCOMMANDS = [
    ["profile"], ["replay"], ["fit"], ["fit", "profile"], ["fit", "shared-reads"],
    ["fit", "clock"], ["bench"], ["bench", "kernels"], ["bench", "tune"], ["validate"],
    ["validate", "run"], ["validate", "prepare"], ["validate", "measure"],
    ["validate", "compare"], ["validate", "diagnostics"],
]
TINY_SCENARIO = """\
name: tiny-validation
model: tiny
cache: {block_size: 4, num_gpu_blocks_override: 256}
scheduler: {max_num_seqs: 4, max_num_batched_tokens: 32, max_model_len: 64}
workload:
  synthetic: {num_requests: 3, arrival: {process: poisson, rate: 20},
              prompt_tokens: {dist: fixed, value: 8}, output_tokens: {dist: fixed, value: 3}}
"""


def simkv(*args, cwd=REPO, without_simpy_in=None, timeout=300) -> subprocess.CompletedProcess:
    """`python -m simkv.cli ARGS`; with `without_simpy_in` (a folder), `import simpy` fails."""
    env = dict(os.environ)
    if without_simpy_in is not None:
        without_simpy_in.mkdir(exist_ok=True)
        (without_simpy_in / "simpy.py").write_text("raise ImportError('no simpy here')\n")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(without_simpy_in), str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "simkv.cli", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv", SUBCOMMANDS, ids=" ".join)
def test_every_subcommand_prints_its_help(argv, capsys):
    assert run_cli([*argv, "--help"]) == 0
    assert f"simkv {' '.join(argv)}" in " ".join(capsys.readouterr().out.split())


def test_the_help_and_the_gpu_side_commands_start_without_simpy(tmp_path):
    for argv in (["--help"], ["profile", "--help"], ["replay", "--help"], ["bench", "--help"],
                 ["validate", "measure", "--help"]):
        result = simkv(*argv, without_simpy_in=tmp_path / "nosimpy")
        assert result.returncode == 0, result.stderr
        assert "Usage: simkv" in result.stdout


def test_the_blocked_simpy_really_fails_to_import(tmp_path):
    result = simkv("run", "scenarios/quickstart.yaml", "--out", tmp_path / "r",
                   without_simpy_in=tmp_path / "nosimpy")
    assert result.returncode != 0 and "no simpy here" in result.stderr


@pytest.fixture(scope="module")
def measured_without_simpy(tmp_path_factory):
    """A tiny scenario measured on CPU by `simkv validate measure` where simpy is missing."""
    folder = tmp_path_factory.mktemp("cli_validate")
    (folder / "s.yaml").write_text(TINY_SCENARIO)
    result = simkv("validate", "measure", folder / "s.yaml", "--device", "cpu", "--out",
                   folder / "measured", without_simpy_in=folder / "nosimpy")
    assert result.returncode == 0, result.stderr
    return folder


def test_validate_measure_runs_on_cpu_without_simpy(measured_without_simpy):
    run = measured_without_simpy / "measured" / "tiny-validation"
    assert (run / "meta.json").is_file()
    assert json.loads((run / "realtime" / "summary.json").read_text())["requests_completed"] == 3


def test_validate_compare_then_diagnostics_read_the_measurement(measured_without_simpy, capsys):
    folder = measured_without_simpy
    result = folder / "result.json"
    assert run_cli(["validate", "compare", str(folder / "s.yaml"), "--measured",
                    str(folder / "measured" / "tiny-validation"), "--out", str(result),
                    "--no-plots"]) == 0
    assert "| tiny-validation |" in capsys.readouterr().out
    assert json.loads(result.read_text())["requests"] == 3
    assert run_cli(["validate", "diagnostics", str(result)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("mean of 1\t")


def test_validate_prepare_says_a_synthetic_workload_needs_no_window(tmp_path, capsys):
    (tmp_path / "s.yaml").write_text(TINY_SCENARIO)
    assert run_cli(["validate", "prepare", str(tmp_path / "s.yaml"), "--data",
                    str(tmp_path / "data")]) == 0
    assert "synthetic, nothing to write" in capsys.readouterr().out


def test_fit_shared_reads_refits_the_committed_savings(tmp_path, capsys):
    out = tmp_path / "shared_reads.json"
    assert run_cli(["fit", "shared-reads", str(PROFILE / "probes" / "shared_blocks"),
                    str(PROFILE / "probes" / "shared_blocks2"), "--profile", str(PROFILE),
                    "--out", str(out)]) == 0
    fitted, committed = (json.loads(p.read_text()) for p in (out, PROFILE / "shared_reads.json"))
    for key in ("saving_first", "saving_further"):
        assert fitted[key] == committed[key]


def test_profile_with_fit_writes_the_raw_csvs_and_the_fit(tmp_path):
    result = simkv("profile", "--model", "tiny", "--quick", "--device", "cpu", "--block-sizes",
                   "16", "--parts", "steps", "--reps", "1", "--out", tmp_path / "p", "--fit",
                   without_simpy_in=tmp_path / "nosimpy")
    assert result.returncode == 0, result.stderr
    assert {"steps.csv", "meta.json", "fit.json"} <= {p.name for p in (tmp_path / "p").iterdir()}
    assert "holdout_error" in json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv, expected", [
    (["profile", "--model", "tiny", "--parts", "steps,bogus"], "unknown part(s) bogus"),
    (["fit", "clock", "nowhere", "--model", "tiny", "--out", "c.json"], "nowhere"),
    (["fit", "shared-reads", "nowhere", "--profile", "nowhere"], "nowhere"),
    (["validate", "diagnostics", "nowhere.json"], "nowhere.json"),
    (["validate", "compare", "s.yaml", "--measured", "m", "--gpu-clock", "fixed"],
     "--gpu-clock needs --out"),
    (["validate", "compare", "s.yaml", "--measured", "m", "--gpu-clock", "slow"],
     "--gpu-clock: 'slow' is not one of auto, fixed"),
    (["validate", "measure", "nothing.yaml", "--device", "cpu"], "nothing.yaml"),
    (["bench", "kernels", "--block-sizes", "16,x"], "--block-sizes"),
])
def test_a_subcommand_given_bad_input_exits_2_with_one_error_line(tmp_path, argv, expected):
    result = simkv(*argv, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


def test_the_short_forms_of_fit_and_validate_stay(tmp_path):
    for argv in (["fit", "nowhere"], ["validate", "nothing.yaml", "--measured", "nowhere"]):
        result = simkv(*argv, cwd=tmp_path)
        assert result.returncode == 2 and result.stderr.startswith("error: "), result.stderr
        assert "No such command" not in result.stderr
