"""Sizing checks for CI: run scenarios and assert bounds on their summaries (`simkv check`).

    checks:
      - name: 8B on one H200 keeps p90 TTFT under 500 ms
        scenario: scenarios/azure-conv.yaml     # relative to the checks file
        set: {cache.block_size: 32}             # optional overrides
        expect: {"ttft_s.p90": "<= 0.5", num_blocks: ">= 20000", leaked_blocks: "== 0"}

An expectation is `OP BOUND` with OP one of <=, <, >=, >, ==, != (a bare value means ==); keys
are summary keys, latency families dotted (`ttft_s.p90`). Everything is validated before any
check runs: the file, each scenario and its overrides, each operator and bound, and each key
(against the summary keys the scenario produces, learnt from a one-request run).
"""
from __future__ import annotations

import operator
import re
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from simkv.config.scenario import load_scenario, with_overrides
from simkv.config.yaml_file import yaml_problem
from simkv.errors import InputError, read_text, strict_yaml
from simkv.limits import RULES
from simkv.whatif.sweep import flatten_summary

OPERATORS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt,
             "==": operator.eq, "!=": operator.ne}
ORDERING = ("<=", "<", ">=", ">")
CHECK_KEYS = ("name", "scenario", "set", "expect")
_EXPECTATION = re.compile(r"^\s*(<=|>=|==|!=|<|>)\s*(\S.*?)\s*$")


@dataclass
class Expectation:
    key: str
    op: str
    bound: Any

    def holds(self, value: Any) -> bool:
        if value is None or (self.op in ORDERING and not _is_number(value)):
            return False
        return bool(OPERATORS[self.op](value, self.bound))

    def describe(self, value: Any) -> str:
        shown = "none" if value is None else f"{value:.6g}" if _is_number(value) else repr(value)
        return f"{self.key}: expected {self.op} {self.bound}, got {shown}"


@dataclass
class Check:
    name: str
    scenario_path: Path
    overrides: dict
    expect: list
    scenario: Any = None        # loaded and validated


@dataclass
class CheckResult:
    check: Check
    values: dict                # key -> value, for every expectation
    failed: list = field(default_factory=list)   # failure lines
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failed


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_SLO_SPELLING = re.compile(r"^(?P<family>[a-z0-9]+)_(?P<stat>p\d+|mean)_s$")


def summary_key(key: str) -> str:
    """The summary's spelling of a latency figure: `ttft_s.p90`. The SLO spelling of the same
    figure (`ttft_p90_s`, as in a scenario's `slo:`) is taken for it, so either may be used."""
    match = _SLO_SPELLING.match(str(key))
    return f"{match['family']}_s.{match['stat']}" if match else str(key)


def parse_expectation(key: str, text: Any, where: str) -> Expectation:
    """`"<= 0.5"` -> Expectation(key, "<=", 0.5); a bare value means `==`; `key` in either
    spelling (`ttft_s.p90` or `ttft_p90_s`: summary_key)."""
    key = summary_key(key)
    if not isinstance(text, str):
        op, bound = "==", text
    else:
        match = _EXPECTATION.match(text)
        if not match:
            raise InputError(f"{where}: expect {key}: {text!r} is not 'OP VALUE' with OP one of "
                             f"{', '.join(OPERATORS)} (e.g. '<= 0.5')")
        op = match.group(1)
        try:
            bound = strict_yaml(match.group(2))
        except yaml.YAMLError:
            bound = match.group(2)
    if op in ORDERING and not _is_number(bound):
        raise InputError(f"{where}: expect {key}: {op} needs a number, got {bound!r}")
    if _is_number(bound) and RULES["check.bound"].problem(bound):
        # a NaN bound holds for nothing (or, with !=, everything); an infinite one says nothing
        raise InputError(f"{where}: expect {key}: the bound must be a finite number, got "
                         f"{bound!r}")
    if isinstance(bound, (dict, list)) or bound is None:
        raise InputError(f"{where}: expect {key}: the bound must be a number or a word, "
                         f"got {bound!r}")
    return Expectation(str(key), op, bound)


def load_checks(path: str | Path) -> list[Check]:
    """Parse and validate a checks file; every scenario is loaded (not run). Raises InputError."""
    path = Path(path)
    try:
        data = strict_yaml(read_text(path, "checks file"))
    except FileNotFoundError:
        raise InputError(f"{path}: no such checks file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a checks YAML file") from None
    except yaml.YAMLError as e:
        raise InputError(f"{path}: bad YAML{yaml_problem(e)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("checks"), list) \
            or not data["checks"]:
        raise InputError(f"{path}: expected a mapping with a non-empty list under 'checks:' "
                         "(each item: name, scenario, set, expect)")
    unknown = [k for k in data if k != "checks"]
    if unknown:
        raise InputError(f"{path}: unknown top-level key {unknown[0]!r}; valid: checks")
    checks = [_load_check(path, i, item) for i, item in enumerate(data["checks"], 1)]
    names = [c.name for c in checks]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise InputError(f"{path}: two checks are named {duplicate!r}; names must be unique")
    return checks


def _load_check(path: Path, index: int, item: Any) -> Check:
    where = f"{path}: check {index}"
    if not isinstance(item, dict):
        raise InputError(f"{where}: expected a mapping with keys {', '.join(CHECK_KEYS)}")
    unknown = [k for k in item if k not in CHECK_KEYS]
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(CHECK_KEYS)}")
    name = str(item.get("name") or f"check {index}")
    where = f"{path}: check {name!r}"
    if not isinstance(item.get("scenario"), str):
        raise InputError(f"{where}: 'scenario' must be a scenario file path (relative to "
                         f"{path.name})")
    overrides = item.get("set") or {}
    if not isinstance(overrides, dict):
        raise InputError(f"{where}: 'set' must be a mapping of dotted keys, e.g. "
                         "{cache.block_size: 32}")
    expect = item.get("expect")
    if not isinstance(expect, dict) or not expect:
        raise InputError(f"{where}: 'expect' must be a non-empty mapping, e.g. "
                         "{\"ttft_s.p90\": \"<= 0.5\"}")
    scenario_path = (path.parent / item["scenario"]).resolve()
    try:
        scenario = load_scenario(scenario_path, {str(k): v for k, v in overrides.items()})
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    expectations = [parse_expectation(k, v, where) for k, v in expect.items()]
    return Check(name, scenario_path, dict(overrides), expectations, scenario)


def check_keys(check: Check, where: str) -> None:
    """Raise InputError if an expectation names a key the check's summary will not have."""
    from simkv.sim.engine import simulate

    probe = simulate(with_overrides(check.scenario, {"workload.limit": 1}))
    known = flatten_summary(probe.summary)
    for exp in check.expect:
        if exp.key not in known:
            raise InputError(f"{where}: check {check.name!r}: expect key {exp.key!r} is not in "
                             f"the summary; valid: {', '.join(known)}")


def run_check(check: Check) -> CheckResult:
    """Simulate the check's scenario and evaluate its expectations."""
    from simkv.sim.engine import simulate

    start = time.perf_counter()
    summary = flatten_summary(simulate(check.scenario).summary)
    values = {exp.key: summary.get(exp.key) for exp in check.expect}
    failed = [exp.describe(values[exp.key]) for exp in check.expect
              if not exp.holds(values[exp.key])]
    return CheckResult(check, values, failed, time.perf_counter() - start)


def junit_xml(results: list[CheckResult], suite: str) -> str:
    """JUnit XML: one testsuite, one testcase per check, a <failure> listing failed expectations."""
    failures = sum(not r.passed for r in results)
    total_s = f"{sum(r.seconds for r in results):.3f}"
    root = ET.Element("testsuites", name="simkv check", tests=str(len(results)),
                      failures=str(failures), errors="0", time=total_s)
    node = ET.SubElement(root, "testsuite", name=suite, tests=str(len(results)),
                         failures=str(failures), errors="0", skipped="0", time=total_s)
    for r in results:
        case = ET.SubElement(node, "testcase", classname=f"simkv.check.{Path(suite).stem}",
                             name=r.check.name, time=f"{r.seconds:.3f}")
        if r.failed:
            failure = ET.SubElement(case, "failure", message=r.failed[0],
                                    type="ExpectationFailed")
            failure.text = "\n".join(r.failed)
        out = ET.SubElement(case, "system-out")
        out.text = "\n".join(f"{exp.key} = {r.values[exp.key]} (expected {exp.op} {exp.bound})"
                             for exp in r.check.expect)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
