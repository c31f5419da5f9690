"""Errors raised where input enters simkv (config, trace, CLI)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml


class InputError(Exception):
    """Bad input: the CLI prints `error: <message>` and exits 2.

    The message names the file, key or row and what would be valid.
    """


def read_json_object(path, missing: str) -> dict:
    """The JSON object in `path`; InputError naming the file when it is missing (`missing`
    says what to do), unreadable, not JSON, or not an object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such file ({missing})") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: unreadable ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_yaml_mapping(path, what: str) -> dict:
    """The mapping in a bundled YAML file (`what`: of what to what, for the message);
    InputError naming the file when it is missing, not YAML, or not a mapping."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: file not found (set SIMKV_PROFILES?)") from None
    except yaml.YAMLError as e:
        raise InputError(f"{path}: bad YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of {what}")
    return data
