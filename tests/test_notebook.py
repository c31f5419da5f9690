"""The capacity report notebook executes end to end (nbclient) on a window of the Azure conv
trace, from the repository root as papermill runs it, with a smaller window, fewer loads and
configurations injected after its parameters cell (papermill-style); its tables, figures and
sentences are then read back from the kernel."""
import json
import os
from pathlib import Path

import nbformat
import pytest
from filelock import FileLock
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "capacity_report.ipynb"
TRACE = ROOT.parent / "shared" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"

# As the notebook's defaults, smaller: 300 requests, three configurations (two alike, one with
# a third of the KV memory), four loads.
PARAMETERS = """
sets = {"workload.limit": 300}
configurations = {"as given": {}, "KV budget 22 GiB": {"cache.memory_budget_gib": 22},
                  "block size 64": {"cache.block_size": 64}}
load_multiples = [1, 2, 4, 6]
capacity_tolerance = 0.08
target_rate_rps = 30.0
"""

READ_BACK = """
import json as _json
_pairs = {}
for _a in names:
    for _b in names:
        if _a != _b:
            _pairs[f"{_a}|{_b}"] = report.difference(
                rates[_a], rates[_b], resolution=capacity_tolerance).within_noise
print("READ_BACK" + _json.dumps({
    "figures": report.describe_figures(figures),
    "capacity": capacity_table[["configuration", "capacity_rps", "planning_rps"]].to_dict("records"),
    "replicates": {n: list(map(float, r)) for n, r in rates.items()},
    "within_noise": _pairs,
    "leaders": report.leaders(rates, resolution=capacity_tolerance),
    "fleet_gpus": dict(zip(fleet_table["configuration"], map(int, fleet_table["gpus"]))),
    "knees": knees,
}))
"""


def markdown(cell) -> str:
    return "".join(o.get("data", {}).get("text/markdown", "") for o in cell.outputs)


def section(nb, heading: str) -> str:
    """The Markdown the code cells under `## heading` displayed."""
    start = next(i for i, c in enumerate(nb.cells)
                 if c.cell_type == "markdown" and c.source.startswith(f"## {heading}"))
    out = []
    for cell in nb.cells[start + 1:]:
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            break
        if cell.cell_type == "code":
            out.append(markdown(cell))
    return "\n".join(out)


def _shared_folder(tmp_path_factory) -> Path:
    """One folder for the whole test session: under pytest-xdist each worker has its own base
    temp, and their parent is the session's, so the notebook runs once, not once per worker."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "capacity-report"


def _execute(folder: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    out = folder / "out"
    nb.cells.insert(params + 1, nbformat.v4.new_code_cell(PARAMETERS + f"out_dir = {str(out)!r}"))
    nb.cells.append(nbformat.v4.new_code_cell(READ_BACK))
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    (folder / "facts.json").write_text(text.split("READ_BACK", 1)[1])
    nbformat.write(nb, folder / "executed.ipynb")       # last: its presence says the run ended


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    if not TRACE.exists():
        pytest.skip(f"the Azure conv trace is not at {TRACE} (see the README: public traces)")
    folder = _shared_folder(tmp_path_factory)
    with FileLock(str(folder) + ".lock"):              # the first worker runs it, the others wait
        if not (folder / "executed.ipynb").exists():
            folder.mkdir(parents=True, exist_ok=True)
            _execute(folder)
    nb = nbformat.read(folder / "executed.ipynb", as_version=4)
    return nb, json.loads((folder / "facts.json").read_text()), folder / "out"


def test_every_configuration_has_a_capacity_and_a_fleet(executed):
    nb, facts, _ = executed
    assert [row["configuration"] for row in facts["capacity"]] == [
        "as given", "KV budget 22 GiB", "block size 64"]
    for row in facts["capacity"]:
        reps = facts["replicates"][row["configuration"]]
        assert len(reps) == 3 and row["capacity_rps"] == reps[0] > 0
        assert row["planning_rps"] == min(reps)
    assert all(g >= 1 for g in facts["fleet_gpus"].values())


def test_the_figures_draw_their_slo_lines_and_keep_legends_outside(executed):
    _, facts, out = executed
    figs = facts["figures"]
    assert set(figs) == {"load_curves", "capacity", "cdfs", "time_series"}
    assert figs["load_curves"]["slo_lines"] == 3      # ttft_s, tpot_s, the 90% target
    assert figs["cdfs"]["slo_lines"] == 2             # ttft_s, tpot_s
    assert figs["load_curves"]["knees"] >= 1
    assert all(f["axes_legends"] == 0 and f["figure_legends"] == 1 for f in figs.values())
    assert all((out / "plots" / f"{name}.png").stat().st_size > 0 for name in figs)


def test_the_loaded_configurations_differ(executed):
    # the cut KV budget is loaded enough to preempt: its capacity differs from the scenario's
    _, facts, _ = executed
    assert not facts["within_noise"]["KV budget 22 GiB|as given"]


def test_prose_says_no_difference_exactly_where_the_numbers_are_within_noise(executed):
    nb, facts, _ = executed
    text = section(nb, "Capacity per configuration")
    for pair, tied in facts["within_noise"].items():
        a, b = pair.split("|")
        if b != "as given":
            continue
        line = next(ln for ln in text.splitlines() if ln.startswith(f"- {a} against {b}:"))
        assert ("no difference within noise" in line) == tied, line
        assert (" is higher than " in line or " is lower than " in line) == (not tied), line
    findings = section(nb, "Findings")
    top = facts["leaders"]
    if len(top) > 1:
        assert "has the highest" not in findings and "no difference within noise" in findings
    else:
        assert f"{top[0]} has the highest figure" in findings


def test_the_record_names_what_was_run(executed):
    _, _, out = executed
    record = json.loads((out / "report_record.json").read_text())
    assert record["scenario"] == "scenarios/azure-conv.yaml"
    assert record["trace"] == TRACE.name and len(record["trace_sha256"]) == 64
    assert record["sets"] == {"workload.limit": 300} and record["replicates"] == 3
    assert record["cost_model"].startswith("profile:h200/llama-3.1-8b")
    assert record["simulations"]["load points"] == 3 * 4
