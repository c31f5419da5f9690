"""The capacity report notebook executes end to end (nbclient), with its default parameters."""
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "capacity_report.ipynb"


def test_capacity_report_executes_and_writes_its_findings(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    # papermill-style: a cell after the parameters overrides them
    nb.cells.insert(params + 1, nbformat.v4.new_code_cell(f"out_dir = {str(tmp_path)!r}"))
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    findings = "".join(out.get("data", {}).get("text/markdown", "")
                       for out in nb.cells[-1].outputs)
    assert "internal fragmentation" in findings and "requests/s" in findings
    assert "take 5% longer than the profile's" in findings
    assert (tmp_path / "plots" / "block_size_study.png").exists()
    assert (tmp_path / "grid" / "sweep.csv").exists()
