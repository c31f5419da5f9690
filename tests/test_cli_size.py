"""`simkv size` end to end, and the command line's entry points."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SIZE_KEYS = {"model", "gpu", "block_size", "kv_dtype", "bytes_per_token", "bytes_per_block",
             "memory_budget_bytes", "weights_bytes", "activation_bytes", "other_bytes",
             "kv_pool_bytes", "num_blocks", "max_cached_tokens", "source"}


def run(*argv: str, cwd: Path = REPO, profiles: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if profiles is not None:
        env["SIMKV_PROFILES"] = str(profiles)
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture
def specs_only(tmp_path):
    """A profiles folder with the bundled specs but no measured profile: sizes are estimates."""
    shutil.copytree(REPO / "profiles" / "models", tmp_path / "models")
    shutil.copy(REPO / "profiles" / "gpus.yaml", tmp_path / "gpus.yaml")
    return tmp_path


def size_json(*args: str, profiles: Path | None = None) -> dict:
    result = run("-m", "simkv.cli", "size", *args, "--json", profiles=profiles)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_size_json_reports_llama_8b_at_block_16(specs_only):
    out = size_json("--model", "llama-3.1-8b", "--block-size", "16", profiles=specs_only)
    assert SIZE_KEYS <= set(out)
    assert (out["model"], out["gpu"], out["block_size"], out["kv_dtype"]) == ("llama-3.1-8b", "h200", 16, "bf16")
    assert out["bytes_per_token"] == 131_072
    assert out["bytes_per_block"] == 2 * 1024 * 1024
    assert out["source"] == "estimate"
    assert out["kv_pool_bytes"] == (out["memory_budget_bytes"] - out["weights_bytes"]
                                    - out["activation_bytes"] - out["other_bytes"])
    assert out["num_gpu_blocks"] == out["kv_pool_bytes"] // out["bytes_per_block"]
    assert out["num_blocks"] == out["num_gpu_blocks"] - 1       # vLLM's null block
    assert out["max_cached_tokens"] == out["num_blocks"] * 16


def test_size_json_with_fp8_halves_the_block_and_roughly_doubles_the_blocks():
    bf16 = size_json("--model", "llama-3.1-8b")
    fp8 = size_json("--model", "llama-3.1-8b", "--kv-dtype", "fp8")
    assert fp8["bytes_per_block"] == bf16["bytes_per_block"] // 2 == 1024 * 1024
    assert fp8["num_gpu_blocks"] in (2 * bf16["num_gpu_blocks"], 2 * bf16["num_gpu_blocks"] + 1)


def test_size_json_with_an_explicit_budget():
    out = size_json("--model", "llama-3.2-1b", "--gpu", "l40s", "--memory-budget-gib", "20")
    assert out["memory_budget_bytes"] == 20 * 1024**3


def test_size_uses_the_committed_h200_profile():
    out = size_json("--model", "llama-3.1-8b", "--block-size", "16")
    assert out["source"] == "profile"
    assert out["num_gpu_blocks"] == out["kv_pool_bytes"] // out["bytes_per_block"]
    assert out["num_blocks"] == out["num_gpu_blocks"] - 1


def test_size_prints_a_table_without_json(specs_only):
    result = run("-m", "simkv.cli", "size", "--model", "llama-3.1-8b", profiles=specs_only)
    assert result.returncode == 0, result.stderr
    assert "131,072" in result.stdout and "2 MiB" in result.stdout and "estimate" in result.stdout


def test_the_top_level_cli_py_shim_is_the_same_command():
    result = run("cli.py", "size", "--model", "tiny", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["bytes_per_token"] == 2 * 2 * 2 * 16 * 2


def test_help_lists_every_documented_command():
    result = run("-m", "simkv.cli", "--help")
    assert result.returncode == 0
    for command in ("size", "run", "sweep", "capacity", "check", "trace", "replay",
                    "profile", "fit", "validate", "bench"):
        assert command in result.stdout


def test_importing_simkv_and_its_cli_loads_neither_torch_nor_pandas():
    code = ("import sys, simkv, simkv.cli; "
            "print(sorted(m for m in ('torch', 'triton', 'pandas', 'simpy') if m in sys.modules))")
    result = run("-c", code)
    assert result.stdout.strip() == "[]", result.stderr
