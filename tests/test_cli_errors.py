"""Bad input through the real command line: exit 2, one line `error: ...` on stderr, no traceback."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GOOD = """\
model: llama-3.1-8b
workload:
  synthetic: {num_requests: 10, arrival: {process: poisson, rate: 1},
              prompt_tokens: {dist: fixed, value: 100}, output_tokens: {dist: fixed, value: 10}}
"""


def simkv(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "simkv.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def llama_config(folder: Path, drop: str = "", **changes) -> Path:
    config = json.loads((REPO / "profiles" / "models" / "llama-3.1-8b.json").read_text())
    config.pop(drop, None)
    config.update(changes)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder / "config.json"


def scenario(tmp: Path, text: str) -> str:
    (tmp / "s.yaml").write_text(text)
    return "s.yaml"


# (case id, function of the temp dir returning the argv, what the one error line must contain)
CASES = [
    ("missing scenario file",
     lambda t: ["run", "nope.yaml"], "nope.yaml: no such scenario file"),
    ("bad yaml",
     lambda t: ["run", scenario(t, "model: [llama\n")], "s.yaml: bad YAML at line 2"),
    ("yaml python tag",
     lambda t: ["run", scenario(t, "model: !!python/object/apply:os.system ['echo hi']\n")],
     "python/ tags are not"),
    ("unknown key with suggestion",
     lambda t: ["run", scenario(t, GOOD + "cache: {blok_size: 16}\n")],
     "s.yaml: unknown key cache.blok_size (did you mean cache.block_size?)"),
    ("block size 12",
     lambda t: ["run", scenario(t, GOOD + "cache: {block_size: 12}\n")],
     "s.yaml: cache.block_size: 12 is not a positive power of two"),
    ("utilisation 1.5",
     lambda t: ["run", scenario(t, GOOD + "cache: {gpu_memory_utilization: 1.5}\n")],
     "cache.gpu_memory_utilization: 1.5 is not in (0, 1]"),
    ("unknown model",
     lambda t: ["run", scenario(t, GOOD.replace("llama-3.1-8b", "llama-3-8b"))],
     "model: unknown model 'llama-3-8b': did you mean llama-3.1-8b?"),
    ("config.json missing num_hidden_layers",
     lambda t: ["size", "--model", str(llama_config(t / "m", drop="num_hidden_layers"))],
     "config.json: missing required field 'num_hidden_layers'"),
    ("unsupported architecture",
     lambda t: ["size", "--model", str(llama_config(t / "m", architectures=["GPT2LMHeadModel"]))],
     "unsupported architecture 'GPT2LMHeadModel' (supported: LlamaForCausalLM"),
    ("bad --set syntax",
     lambda t: ["run", scenario(t, GOOD), "--set", "cache.block_size"],
     "--set 'cache.block_size': expected KEY=VALUE"),
    ("--set of the wrong type",
     lambda t: ["run", scenario(t, GOOD), "--set", "scheduler.max_num_seqs=lots"],
     "scheduler.max_num_seqs: expected an integer or null, got 'lots'"),
    ("--set of an unknown key",
     lambda t: ["run", scenario(t, GOOD), "--set", "scheduler.max_num_seq=8"],
     "unknown key scheduler.max_num_seq (did you mean scheduler.max_num_seqs?)"),
    ("model too big for the budget",
     lambda t: ["run", scenario(t, GOOD.replace("llama-3.1-8b", "llama-3.1-70b") + "gpu: h100\n")],
     "llama-3.1-70b needs 134.0 GiB on h100"),
    ("model too big for size",
     lambda t: ["size", "--model", "llama-3.1-8b", "--memory-budget-gib", "10"],
     "budget is 10.0 GiB"),
    ("pool smaller than max_model_len",
     lambda t: ["run", scenario(t, GOOD + "cache: {num_gpu_blocks_override: 10}\n")],
     "pool holds 160 tokens (10 blocks of 16); max_model_len is 131072"),
    ("unknown gpu",
     lambda t: ["size", "--model", "llama-3.1-8b", "--gpu", "h300"], "unknown gpu 'h300'"),
    ("no workload",
     lambda t: ["run", scenario(t, "model: llama-3.1-8b\n")], "workload: set workload.trace"),
    ("size block size not an integer",
     lambda t: ["size", "--model", "llama-3.1-8b", "--block-size", "abc"],
     "simkv size: Invalid value for '--block-size'"),
    ("size block size not a power of two",
     lambda t: ["size", "--model", "llama-3.1-8b", "--block-size", "24"],
     "--block-size: 24 is not a positive power of two"),
    ("size kv dtype",
     lambda t: ["size", "--model", "llama-3.1-8b", "--kv-dtype", "fp4"],
     "--kv-dtype: 'fp4' is not one of bf16, fp8"),
    ("size without --model",
     lambda t: ["size"], "simkv size: Missing option '--model'"),
    ("unknown command",
     lambda t: ["simulate"], "No such command 'simulate'"),
    ("trace stats of a missing file",
     lambda t: ["trace", "stats", "missing.csv"], "missing.csv"),
    ("trace format",
     lambda t: ["trace", "stats", "missing.csv", "--format", "parquet"],
     "--format: 'parquet' is not one of auto, azure"),
    ("capacity of a missing scenario",
     lambda t: ["capacity", "s.yaml"], "s.yaml: no such scenario file"),
    ("sweep with a malformed grid",
     lambda t: ["sweep", "s.yaml", "--grid", "cache.block_size"], "cache.block_size"),
    ("check of a missing checks file",
     lambda t: ["check", "checks.yaml"], "checks.yaml"),
    ("replay on an unknown device",
     lambda t: ["replay", "s.yaml", "--device", "tpu"], "--device: 'tpu' is not one of cuda, cpu"),
    ("profile with bad block sizes",
     lambda t: ["profile", "--model", "tiny", "--block-sizes", "16,x"], "--block-sizes"),
    ("fit of a missing profile folder",
     lambda t: ["fit", "nowhere"], "nowhere"),
]


@pytest.mark.parametrize("argv_of, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_error_line(tmp_path, argv_of, expected):
    result = simkv(*argv_of(tmp_path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert expected in lines[0]


def test_validate_of_a_missing_scenario_is_bad_input(tmp_path):
    result = simkv("validate", "nothing.yaml", "--measured", "nowhere", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1
