"""The profiler of a tensor-parallel replica on CPU (gloo, 2 ranks): every rank's all-reduce
times per message size beside rank 0's step grid, and metadata saying the replica's size."""
import csv
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from simkv.costmodel.allreduce import read_measured  # noqa: E402
from simkv.gpu.profiler.command import main  # noqa: E402
from simkv.gpu.profiler.tensor_parallel import QUICK_SIZES  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tp2")
    assert main(["--model", "tiny", "--quick", "--device", "cpu", "--block-sizes", "16",
                 "--tensor-parallel-size", "2", "--out", str(out)]) == 0
    return out


def test_every_rank_times_every_message_size(profile):
    with open(profile / "allreduce.csv") as f:
        rows = list(csv.DictReader(f))
    seen = {(int(r["rank"]), int(r["message_bytes"])) for r in rows}
    assert seen == {(rank, size) for rank in (0, 1) for size in QUICK_SIZES}
    assert all(float(r["seconds"]) > 0 and r["backend"] == "gloo" and r["ranks"] == "2"
               for r in rows)
    assert len(rows) == 2 * len(QUICK_SIZES) * 5           # 5 timed calls per size (quick)


def test_the_metadata_says_the_replicas_size_and_the_parts(profile):
    meta = json.loads((profile / "meta.json").read_text())
    assert meta["tensor_parallel_size"] == 2 and meta["backend"] == "gloo"
    assert meta["parts"] == ["steps", "transfers", "allreduce"]
    with open(profile / "steps.csv") as f:
        assert len(list(csv.DictReader(f))) > 0              # rank 0's step grid


def test_the_cost_model_reads_the_measured_all_reduces(profile):
    ar = read_measured(profile / "allreduce.csv", 2)
    assert ar.sizes == QUICK_SIZES and all(s > 0 for s in ar.seconds_at)


def test_parts_a_tp_profile_does_not_measure_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--tensor-parallel-size", "2", "--parts", "ledger"])
    assert "choose from steps, transfers, allreduce" in capsys.readouterr().err


# `nvidia-smi topo -m` as the H200 machines print it (one GPU: recorded 2026-12-02; two: its
# layout with the NVLink count of an H200 board), with the underline escapes of the header row
TOPO_ONE = ("\t\x1b[4mGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
            "GPU0\t X \t0-15\t0\t\tN/A\n\nLegend:\n\n  X    = Self\n")
TOPO_TWO = ("\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
            "GPU0\t X \tNV18\t0-31\t0\t\tN/A\nGPU1\tNV18\t X \t0-31\t0\t\tN/A\n")


@pytest.mark.parametrize("text, link", [(TOPO_ONE, "one GPU (nvidia-smi topo -m lists no GPU1)"),
                                        (TOPO_TWO, "GPU0-GPU1 NV18 (nvidia-smi topo -m)")])
def test_the_link_is_read_from_the_gpu1_column_of_gpu0s_row(monkeypatch, text, link):
    import subprocess
    from types import SimpleNamespace
    from simkv.gpu.profiler import tensor_parallel as tp_profiler
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=text))
    assert tp_profiler._link_summary() == link
