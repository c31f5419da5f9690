"""Measuring a tensor-parallel validation scenario: `measure_validation` on every rank.

Each rank serves the scenario's requests with its shards (simkv.gpu.tensor_parallel: the same
scheduler decisions, rank 0's clock), saturated and then in real time, as one GPU's measurement
does (simkv.validation.measure); rank 0's runs are written to the measurement folder, whose
meta.json says `tensor_parallel_size`. `simkv validate measure` takes this path for a scenario
with tensor_parallel_size > 1, and `simkv validate compare` compares it as any other.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from simkv.validation.measure import _Bench, measure_validation


class _RankBench(_Bench):
    """The validation bench of one rank: its engines are the rank's."""

    def __init__(self, rank: int, world_size: int, device: str, **kwargs):
        super().__init__(device, **kwargs)
        self.rank, self.world_size = rank, world_size

    def new_engine(self, scn, executor=None):
        from simkv.gpu.tensor_parallel import rank_engine
        return rank_engine(scn, self.rank, self.world_size, self.device, {}, executor)


def _measure_job(rank: int, world_size: int, device: str, job: dict) -> str:
    from simkv.validation.data import load_validation_scenario
    scn = load_validation_scenario(job["scenario"], job["data_dir"])
    bench = _RankBench(rank, world_size, device, progress=job["progress"] and rank == 0)
    with tempfile.TemporaryDirectory(prefix=f"simkv-rank{rank}-") as scratch:
        out = Path(job["out_dir"]) if rank == 0 else Path(scratch)
        measure_validation(scn, out, device, write_trace=job["write_trace"], _bench=bench)
        if rank == 0:
            meta = json.loads((out / "meta.json").read_text())
            meta["tensor_parallel_size"] = world_size
            (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    bench.release()
    return str(out)


def measure_tensor_parallel(scenario_path, out_dir, device: str = "cuda", *, data_dir=None,
                            progress: bool = False, write_trace: bool = True) -> Path:
    """Measure one tensor-parallel validation scenario into `out_dir` (rank 0's runs)."""
    from simkv.gpu.tensor_parallel import launch
    from simkv.validation.data import load_validation_scenario
    scn = load_validation_scenario(scenario_path, data_dir)
    job = {"run": _measure_job, "device": device, "scenario": str(scenario_path),
           "data_dir": data_dir, "out_dir": str(out_dir), "progress": progress,
           "write_trace": write_trace}
    return Path(launch(scn.tensor_parallel_size, job))
