"""The scenario's settable dotted keys, their types, and `--set` values converted to them.

Every key a scenario may set is in KEY_TYPES (slo.* and workload.synthetic.* are open), or is a
`cluster.` key (`cluster_key_type`: pools addressed by list index, `cluster.pools.0.replicas`);
an unknown key raises InputError with the closest valid one.
"""
from __future__ import annotations

import copy
import difflib
import re
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from simkv.config.sections import CacheConfig, SchedulerConfig, WorkloadConfig
from simkv.errors import InputError, strict_yaml

SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "workload": WorkloadConfig}
TOP_LEVEL_TYPES: dict[str, tuple[type, bool]] = {
    "name": (str, False),
    "model": (str, False),
    "weights_dtype": (str, False),     # bf16 | fp8 | int4 | mxfp4; default: the checkpoint's
    "gpu": (str, False),
    "cost_model": (str, False),
    "gpu_clock": (str, False),
    "step_time_scale": (float, False),
    "seed": (int, False),
    "semantics": (str, False),
    "tensor_parallel_size": (int, False),   # GPUs one replica is split over (simkv.parallel)
}
# `cost_model:` is a string (its source) or a mapping of these
COST_MODEL_TYPES: dict[str, tuple[type, bool]] = {
    "cost_model.source": (str, False),
    "cost_model.effects": (list, False),
    "cost_model.step_time_scale": (float, False),
    "cost_model.expert_skew": (float, False),    # roofline: Zipf skew of MoE routing (0 uniform)
}
EFFECTS = ("clock", "shared_reads", "engine_host")   # the cost model's layers, in order
FREE_FORM = "workload.synthetic"    # its contents belong to the workload generator
SLO_KEY = re.compile(r"^(ttft|tpot|itl|e2e|queue)(_p\d{1,2}|_mean)?_s$")
SLO_EXAMPLES = "ttft_s, tpot_s, itl_s, e2e_s, queue_s, with _pNN or _mean before _s (ttft_p90_s)"
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NULL = ("null", "none", "~", "")


def field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """Field name -> (base type, optional) of a config dataclass."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = typing.get_origin(hint) is typing.Union and len(args) < len(typing.get_args(hint))
        base = args[0] if optional else hint
        out[f.name] = (typing.get_origin(base) or base, optional)
    return out


# Every settable dotted key and its (type, optional); slo.* and workload.synthetic.* are open.
KEY_TYPES: dict[str, tuple[type, bool]] = {**TOP_LEVEL_TYPES, **COST_MODEL_TYPES}
for _section, _cls in SECTIONS.items():
    KEY_TYPES.update({f"{_section}.{k}": t for k, t in field_types(_cls).items()})

# `cluster:` (simkv.config.cluster): the router's and the link's keys, and each pool's (by index)
ROUTER_TYPES: dict[str, tuple[type, bool]] = {
    "policy": (str, False), "refresh_s": (float, False), "seed": (int, True),
    "prefix_blocks": (int, False), "load_factor": (float, False),
    "virtual_nodes": (int, False), "prefix_weight": (float, False),
    "queue_weight": (float, False), "kv_weight": (float, False),
}
LINK_TYPES: dict[str, tuple[type, bool]] = {
    "link": (str, True), "bandwidth_gbps": (float, True), "latency_s": (float, True),
}
POOL_TYPES: dict[str, tuple[type, bool]] = {
    "name": (str, False), "replicas": (int, False), "role": (str, False),
    "gpu": (str, False), "model": (str, False), "cost_model": (str, False),
    "tensor_parallel_size": (int, False),
}
POOL_SECTIONS = ("cache", "scheduler")     # a pool's overrides of these, key by key
CLUSTER_KEYS = ["cluster.router", "cluster.pools", "cluster.kv_transfer",
                *(f"cluster.router.{k}" for k in ROUTER_TYPES),
                *(f"cluster.kv_transfer.{k}" for k in LINK_TYPES),
                *(f"cluster.pools.0.{k}" for k in POOL_TYPES)]
VALID_KEYS = sorted([*KEY_TYPES, *SECTIONS, "slo", "cluster", *CLUSTER_KEYS])


def cluster_key_type(key: str) -> tuple[type, bool] | None:
    """(type, optional) of a `cluster.` dotted key, or None when it names no setting;
    `cluster.pools.N` and the cluster's sections themselves are mappings or lists."""
    parts = key.split(".")
    if parts[0] != "cluster":
        return None
    if len(parts) == 1:
        return dict, False
    section, rest = parts[1], parts[2:]
    if section == "router":
        return (dict, False) if not rest else ROUTER_TYPES.get(".".join(rest))
    if section == "kv_transfer":
        return (dict, True) if not rest else LINK_TYPES.get(".".join(rest))
    if section == "pools":
        if not rest:
            return list, False
        if not rest[0].isdigit():
            return None
        rest = rest[1:]
        if not rest:
            return dict, False
        if len(rest) == 1:
            if rest[0] in POOL_SECTIONS:
                return dict, False
            return POOL_TYPES.get(rest[0])
        if len(rest) == 2 and rest[0] in POOL_SECTIONS:
            return KEY_TYPES.get(f"{rest[0]}.{rest[1]}")
    return None


def suggest(key: str) -> str:
    """' (did you mean X?)' for the valid key closest to `key`, or ''. A right name in the
    wrong section (scheduler.preemption_mode) names the section that has it."""
    leaf = key.rsplit(".", 1)[-1]
    moved = [k for k in VALID_KEYS if k.rsplit(".", 1)[-1] == leaf and k != key]
    if len(moved) == 1:
        return f" (did you mean {moved[0]}?)"
    close = difflib.get_close_matches(key, VALID_KEYS, n=1, cutoff=0.6)
    if not close:  # a right name in the wrong section, e.g. cache.max_num_seqs
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[-1]: k for k in VALID_KEYS}
        near = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
        close = [leaves[near[0]]] if near else []
    return f" (did you mean {close[0]}?)" if close else ""


def check_key(key: str, where: str) -> None:
    """Raise unless `key` is a settable dotted key."""
    if key in KEY_TYPES or key.startswith(FREE_FORM + ".") or key == FREE_FORM:
        return
    if key.startswith("cluster"):
        if cluster_key_type(key) is not None:
            return
        raise InputError(f"{where}: unknown key {key}{suggest(_index_as_zero(key))}")
    if key.startswith("slo."):
        if SLO_KEY.match(key[4:]):
            return
        raise InputError(f"{where}: unknown SLO key {key} (valid: {SLO_EXAMPLES})")
    raise InputError(f"{where}: unknown key {key}{suggest(key)}")


def _index_as_zero(key: str) -> str:
    """`cluster.pools.3.x` -> `cluster.pools.0.x`, for the closest-key hint."""
    parts = key.split(".")
    if len(parts) > 2 and parts[:2] == ["cluster", "pools"] and parts[2].isdigit():
        parts[2] = "0"
    return ".".join(parts)


def type_name(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            Path: "a path", dict: "a mapping", list: "a list"}.get(kind, kind.__name__)


def convert(text: str, key: str, where: str) -> Any:
    """Convert a --set string to the type of `key` (int, float, bool, str, null for Optional)."""
    if key.startswith("slo."):
        kind, optional = float, True
    elif key in KEY_TYPES:
        kind, optional = KEY_TYPES[key]
    elif cluster_key_type(key) is not None:
        kind, optional = cluster_key_type(key)
    else:  # free-form (workload.synthetic...): read the value as YAML
        try:
            return strict_yaml(text)
        except yaml.YAMLError:
            return text
    lowered = text.strip().lower()
    if optional and lowered in _NULL:
        return None
    try:
        if kind is bool:
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is dict:
            value = strict_yaml(text)
            if not isinstance(value, dict):
                raise ValueError
            return value
        if kind is list:      # [a, b], [] or a,b
            value = strict_yaml(text)
            if isinstance(value, str):
                value = [part.strip() for part in value.split(",") if part.strip()]
            if value is None:
                value = []
            if not isinstance(value, list):
                raise ValueError
            return value
    except (ValueError, yaml.YAMLError):
        null = " or null" if optional else ""
        raise InputError(
            f"{where}: {key}: expected {type_name(kind)}{null}, got {text!r}"
        ) from None
    return text  # str, Path


def parse_set(items: list[str]) -> dict[str, Any]:
    """Parse `--set KEY=VALUE` items into {dotted key: value typed as the key's field}."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError(f"--set {item!r}: expected KEY=VALUE (e.g. cache.block_size=32)")
        check_key(key, "--set")
        out[key] = convert(text, key, "--set")
    return out


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of the scenario dict `raw` with each dotted key of `overrides` set.

    String values are converted to the key's type, as `--set` does; other values are kept and
    type-checked later with the rest of the scenario.
    """
    merged = copy.deepcopy(raw)
    if any(key.startswith("cost_model.") for key in overrides) \
            and not isinstance(merged.get("cost_model"), dict):
        merged["cost_model"] = {"source": merged.get("cost_model") or "auto"}
    for key, value in overrides.items():
        check_key(key, "--set")
        if isinstance(value, str):
            value = convert(value, key, "--set")
        node = merged
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):          # cluster.pools.N: an entry of the list
                node = node[_list_index(node, part, key, parts[: i + 1])]
                if not isinstance(node, dict):
                    raise InputError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a mapping")
                continue
            if not isinstance(node.get(part), (dict, list)):
                if node.get(part) is not None:
                    raise InputError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a mapping")
                if parts[i + 1].isdigit():
                    raise InputError(f"--set {key}: the scenario has no {'.'.join(parts[: i + 1])}"
                                     " list to index")
                node[part] = {}
            node = node[part]
        if isinstance(node, list):
            node[_list_index(node, parts[-1], key, parts)] = value
        else:
            node[parts[-1]] = value
    return merged


def _list_index(node: list, part: str, key: str, path: list) -> int:
    """The list index `part` of a dotted key, checked against the list's length."""
    if not part.isdigit() or int(part) >= len(node):
        raise InputError(f"--set {key}: {'.'.join(path)}: no such entry (the list has "
                         f"{len(node)}, indexed from 0)")
    return int(part)

