"""Errors raised where input enters simkv (config, trace, CLI), and the readers of input files
that turn every problem into one."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


class InputError(Exception):
    """Bad input: the CLI prints `error: <message>` and exits 2.

    The message names the file, key or row and what would be valid.
    """


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader refusing a key given twice in one mapping (plain YAML keeps the
    last silently: a second `cache:` section would replace the first)."""


def _strict_mapping(loader: StrictLoader, node, deep: bool = False):
    loader.flatten_mapping(node)
    seen: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                "found an unhashable key (a list or mapping used as a key)",
                key_node.start_mark) from None
        if first is not key_node:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping", node.start_mark,
                f"duplicate key {key!r} (first at line {first.start_mark.line + 1}); give each "
                f"key once", key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _strict_mapping)


def strict_yaml(text: str) -> Any:
    """YAML text as data: PyYAML's safe subset, duplicate keys refused (yaml.YAMLError)."""
    return yaml.load(text, Loader=StrictLoader)


def read_text(path, what: str = "file") -> str:
    """The UTF-8 text of `path` (a BOM is dropped); InputError naming the file when it is not
    UTF-8. FileNotFoundError and other OSErrors are the caller's to word."""
    path = Path(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise InputError(f"{path}: line {line}: not UTF-8 text (byte 0x{data[e.start]:02x}); "
                         f"save the {what} as UTF-8") from None


def read_json_object(path, missing: str) -> dict:
    """The JSON object in `path`; InputError naming the file when it is missing (`missing`
    says what to do), unreadable, not JSON, or not an object."""
    path = Path(path)
    try:
        data = json.loads(read_text(path, "JSON file"))
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
    InputError naming the file when it is missing, not UTF-8, not YAML (duplicate keys
    included), or not a mapping."""
    path = Path(path)
    try:
        data = strict_yaml(read_text(path, "YAML file"))
    except FileNotFoundError:
        raise InputError(f"{path}: file not found (set SIMKV_PROFILES?)") from None
    except yaml.YAMLError as e:
        raise InputError(f"{path}: bad YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of {what}")
    return data
