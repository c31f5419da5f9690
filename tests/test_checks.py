"""`simkv check`: exit codes, the failed expectation's key/bound/value, JUnit XML, bad input."""
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from simkv.errors import InputError
from simkv.whatif.checks import parse_expectation
from simkv.whatif.commands import check_command

REPO = Path(__file__).resolve().parent.parent
TINY = """\
name: tiny
model: llama-3.1-8b
gpu: h200
cache: {block_size: 16, memory_budget_gib: 24}
scheduler: {max_model_len: 4096}
workload:
  synthetic: {num_requests: 40, arrival: {process: poisson, rate: 10},
              prompt_tokens: {dist: fixed, value: 500}, output_tokens: {dist: fixed, value: 20}}
"""


def write_checks(tmp_path: Path, expect: str, scenario: str = "scenarios/tiny.yaml",
                 extra: str = "") -> Path:
    (tmp_path / "scenarios").mkdir(exist_ok=True)
    (tmp_path / "scenarios" / "tiny.yaml").write_text(TINY)
    path = tmp_path / "checks.yaml"
    path.write_text(f"checks:\n  - name: tiny check\n    scenario: {scenario}\n"
                    f"    set: {{cache.block_size: 32}}\n    expect: {expect}\n{extra}")
    return path


def test_satisfied_checks_exit_0_and_write_junit(tmp_path, capsys):
    path = write_checks(tmp_path, '{"ttft_s.p90": "< 10", leaked_blocks: "== 0", '
                                  'block_size: 32, requests_completed: ">= 40"}')
    assert check_command(path, tmp_path / "junit.xml") == 0
    assert "PASS  tiny check" in capsys.readouterr().out
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert suite.get("tests") == "1" and suite.get("failures") == "0"
    assert suite.find("testcase").get("name") == "tiny check"
    assert suite.find("testcase/failure") is None


def test_a_violated_check_exits_1_naming_metric_bound_and_value(tmp_path, capsys):
    path = write_checks(tmp_path, '{"ttft_s.p90": "<= 0.000001", num_blocks: ">= 100"}')
    assert check_command(path, tmp_path / "out" / "junit.xml") == 1
    out = capsys.readouterr().out
    assert "FAIL  tiny check" in out
    line = next(line for line in out.splitlines() if "ttft_s.p90" in line)
    assert "expected <= 1e-06, got 0." in line
    assert "num_blocks" not in out  # that one held
    failure = ET.parse(tmp_path / "out" / "junit.xml").getroot().find(
        "testsuite/testcase/failure")
    assert failure is not None and "ttft_s.p90: expected <= 1e-06" in failure.get("message")


@pytest.mark.parametrize("expect, scenario, message", [
    ('{ttft_p90: "<= 0.5"}', "scenarios/tiny.yaml", "expect key 'ttft_p90' is not in the summary"),
    ('{"ttft_s.p90": "=< 0.5"}', "scenarios/tiny.yaml", "is not 'OP VALUE'"),
    ('{"ttft_s.p90": "<= fast"}', "scenarios/tiny.yaml", "<= needs a number"),
    ('{"ttft_s.p90": "<= 0.5"}', "scenarios/missing.yaml", "missing.yaml: no such scenario file"),
])
def test_bad_checks_are_input_errors(tmp_path, expect, scenario, message):
    path = write_checks(tmp_path, expect, scenario)
    with pytest.raises(InputError, match=message):
        check_command(path, tmp_path / "junit.xml")
    assert not (tmp_path / "junit.xml").exists()


def test_a_missing_checks_file_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="no such checks file"):
        check_command(tmp_path / "nope.yaml", None)


def test_a_bare_value_means_equal():
    exp = parse_expectation("leaked_blocks", 0, "checks.yaml")
    assert (exp.op, exp.bound) == ("==", 0) and exp.holds(0) and not exp.holds(1)


def test_a_missing_value_fails_an_ordering_expectation():
    assert not parse_expectation("ttft_s.p90", "<= 1", "checks.yaml").holds(None)


def test_the_repository_checks_file_passes(tmp_path):
    assert check_command(REPO / "checks.yaml", tmp_path / "junit.xml") == 0
