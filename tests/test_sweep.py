"""`simkv sweep`: grids, identical results on both backends, files that survive kill -9, resume."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from simkv.errors import InputError
from simkv.whatif.commands import sweep_command
from simkv.whatif.sweep import grid_points, parse_grid, run_sweep

REPO = Path(__file__).resolve().parent.parent
TINY = """\
name: tiny
model: llama-3.1-8b
gpu: h200
cache: {block_size: 16, memory_budget_gib: 24}
scheduler: {max_model_len: 4096}
workload:
  synthetic: {num_requests: 60, arrival: {process: poisson, rate: 10},
              prompt_tokens: {dist: lognormal, mean: 600, sigma: 0.8, max: 3000},
              output_tokens: {dist: fixed, value: 40}}
slo: {ttft_s: 0.5, tpot_s: 0.05}
"""


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def test_grid_values_are_typed_as_their_keys():
    grid = parse_grid(["cache.block_size=8,16", "cache.memory_budget_gib=20,30.5",
                       "cache.allocator=paged,contiguous"])
    assert grid == {"cache.block_size": [8, 16], "cache.memory_budget_gib": [20.0, 30.5],
                    "cache.allocator": ["paged", "contiguous"]}


def test_grid_points_vary_the_last_key_fastest():
    points = grid_points({"a.x": [1, 2], "b.y": [3, 4]})
    assert points == [{"a.x": 1, "b.y": 3}, {"a.x": 1, "b.y": 4},
                      {"a.x": 2, "b.y": 3}, {"a.x": 2, "b.y": 4}]


@pytest.mark.parametrize("items, message", [
    (["cache.blok_size=8,16"], "did you mean cache.block_size"),
    (["cache.block_size"], "expected KEY=V1,V2"),
    (["cache.block_size=8,x"], "expected an integer"),
    (["cache.block_size=8", "cache.block_size=16"], "given twice"),
    (["cache.block_size=8,8"], "repeated"),
])
def test_bad_grid_is_input_error(items, message):
    with pytest.raises(InputError, match=message):
        parse_grid(items)


def test_an_impossible_grid_point_fails_before_anything_runs(tiny, tmp_path):
    grid = parse_grid(["cache.memory_budget_gib=24,10"])   # 10 GiB cannot hold the weights
    with pytest.raises(InputError, match="grid point cache.memory_budget_gib=10"):
        run_sweep(tiny, grid, tmp_path / "out", workers=1)
    assert not (tmp_path / "out" / "sweep.csv").exists()


def test_sweep_csv_has_grid_keys_then_flattened_summary_in_grid_order(tiny, tmp_path):
    grid = parse_grid(["cache.block_size=32,8"])
    frame = run_sweep(tiny, grid, tmp_path / "out", workers=2)
    csv = pd.read_csv(tmp_path / "out" / "sweep.csv")
    assert list(csv["cache.block_size"]) == [32, 8]
    assert list(csv.columns[:3]) == ["cache.block_size", "requests_total", "requests_completed"]
    assert {"ttft_s.p90", "tpot_s.p50", "blocks_per_seq.mean", "wall_time_s"} <= set(csv.columns)
    assert len(list((tmp_path / "out" / "points").glob("*.json"))) == 2
    assert list(frame["block_size"]) == [32, 8]


def test_local_and_dask_backends_write_identical_sweep_csv(tiny, tmp_path):
    grid = parse_grid(["cache.block_size=8,32", "workload.time_scale=1.0,0.5"])
    run_sweep(tiny, grid, tmp_path / "local", backend="local", workers=2)
    run_sweep(tiny, grid, tmp_path / "dask", backend="dask", workers=2)
    local = (tmp_path / "local" / "sweep.csv").read_text().splitlines()
    dask = (tmp_path / "dask" / "sweep.csv").read_text().splitlines()
    wall = local[0].split(",").index("wall_time_s")

    def without_wall_time(lines):
        return [[cell for i, cell in enumerate(line.split(",")) if i != wall] for line in lines]

    assert len(local) == 5
    assert without_wall_time(local) == without_wall_time(dask)


def test_an_existing_sweep_folder_needs_resume(tiny, tmp_path):
    grid = parse_grid(["cache.block_size=16"])
    run_sweep(tiny, grid, tmp_path / "out", workers=1)
    with pytest.raises(InputError, match="pass --resume"):
        run_sweep(tiny, grid, tmp_path / "out", workers=1)


def test_resume_refuses_a_different_scenario(tiny, tmp_path):
    grid = parse_grid(["cache.block_size=16"])
    run_sweep(tiny, grid, tmp_path / "out", workers=1)
    with pytest.raises(InputError, match="another scenario or other --set"):
        run_sweep(tiny, grid, tmp_path / "out", workers=1, resume=True,
                  sets={"scheduler.max_num_seqs": 64})


def test_resume_with_a_larger_grid_runs_only_the_new_points(tiny, tmp_path):
    out = tmp_path / "out"
    run_sweep(tiny, parse_grid(["cache.block_size=8,16"]), out, workers=1)
    before = {p.name: p.stat().st_mtime_ns for p in (out / "points").glob("*.json")}
    frame = run_sweep(tiny, parse_grid(["cache.block_size=8,16,32"]), out, workers=1,
                      resume=True)
    after = {p.name: p.stat().st_mtime_ns for p in (out / "points").glob("*.json")}
    assert list(frame["cache.block_size"]) == [8, 16, 32]
    assert len(after) == 3 and all(after[name] == t for name, t in before.items())


KILLABLE = """
import sys
from simkv.whatif.sweep import parse_grid, run_sweep
run_sweep(sys.argv[1], parse_grid(["workload.synthetic.num_requests=300,301,302,303,304,305"]),
          sys.argv[2], workers=1, resume=len(sys.argv) > 3)
"""


def test_a_sweep_killed_with_sigkill_resumes_to_a_complete_duplicate_free_csv(tiny, tmp_path):
    out = tmp_path / "out"
    csv = out / "sweep.csv"
    proc = subprocess.Popen([sys.executable, "-c", KILLABLE, str(tiny), str(out)],
                            start_new_session=True, cwd=REPO)
    deadline = time.monotonic() + 60
    try:   # kill the whole process group (the sweep and its pool) once two points are in
        while time.monotonic() < deadline and proc.poll() is None:
            if csv.exists() and len(pd.read_csv(csv)) >= 2:
                break
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done_before = pd.read_csv(csv)   # a complete file, never a half-written row
    assert 2 <= len(done_before) < 6, "the sweep should have been killed mid-way"
    kept = {p.name: p.stat().st_mtime_ns for p in (out / "points").glob("*.json")}

    subprocess.run([sys.executable, "-c", KILLABLE, str(tiny), str(out), "resume"],
                   check=True, cwd=REPO, timeout=120)
    final = pd.read_csv(csv)
    assert list(final["workload.synthetic.num_requests"]) == [300, 301, 302, 303, 304, 305]
    assert not final["workload.synthetic.num_requests"].duplicated().any()
    assert list(final["requests_total"]) == [300, 301, 302, 303, 304, 305]
    after = {p.name: p.stat().st_mtime_ns for p in (out / "points").glob("*.json")}
    assert all(after[name] == t for name, t in kept.items()), "finished points ran again"
    assert not [p for p in out.rglob(".*") if p.is_file()], "temp files left behind"


def test_sweep_command_writes_csv_points_and_plots(tiny, tmp_path, capsys):
    code = sweep_command(tiny, ["cache.block_size=16,64"], ["workload.time_scale=0.5"],
                         backend="local", dask_address=None, out_dir=tmp_path / "out",
                         resume=False, workers=2)
    assert code == 0
    manifest = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert manifest["sets"] == {"workload.time_scale": 0.5}
    assert {p.name for p in (tmp_path / "out" / "plots").iterdir()} == {
        "block_size_study.png", "block_size_study.svg"}
    assert "2 point(s)" in capsys.readouterr().out
