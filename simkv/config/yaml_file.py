"""Reading a scenario YAML file: a mapping of scenario keys, or an InputError naming the file
and, for bad YAML (a key given twice included), the line and column."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from simkv.errors import InputError, read_text, strict_yaml


def read_yaml(path: Path) -> dict[str, Any]:
    """The scenario file at `path` as a dict (InputError: missing, not UTF-8, not YAML, a key
    given twice, not a mapping)."""
    try:
        text = read_text(path, "scenario")
    except FileNotFoundError:
        raise InputError(f"{path}: no such scenario file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a scenario YAML file") from None
    try:
        data = strict_yaml(text)
    except yaml.YAMLError as e:
        raise InputError(f"{path}: bad YAML{yaml_problem(e)}") from None
    if data is None:
        raise InputError(f"{path}: empty scenario (expected a mapping with at least 'model')")
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of scenario keys, got {type(data).__name__}")
    return data


def yaml_problem(e: yaml.YAMLError) -> str:
    """' at line L, column C: problem' from a PyYAML error, on one line."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(e, "problem", None) or str(e)
    problem = " ".join(str(problem).split())
    if "python/" in problem:
        problem += " (only plain YAML is accepted; python/ tags are not)"
    return f"{where}: {problem}"

