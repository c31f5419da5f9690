"""Scenario configuration: typed dataclasses with the defaults of INTERFACE.md.

Loading (YAML, --set overrides, validation) lives below the dataclasses; the core trusts a
Scenario once it is built.
"""
from __future__ import annotations

import copy
import difflib
import re
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import yaml

from simkv.errors import InputError


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    memory_budget_gib: Optional[float] = None   # when set, wins over gpu_memory_utilization
    kv_dtype: str = "bf16"                      # bf16 | fp8
    allocator: str = "paged"                    # paged | contiguous
    enable_prefix_caching: bool = True
    prefix_sharing_scope: str = "tenant"        # tenant | global
    watermark: float = 0.0                      # fraction of blocks kept free at admission
    preemption_mode: str = "recompute"          # recompute | swap
    swap_space_gib: float = 4.0
    num_gpu_blocks_override: Optional[int] = None


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0       # 0 = no per-request cap beyond the budget
    max_model_len: Optional[int] = None         # None = the model's max_position_embeddings
    preemption_policy: str = "recent"           # recent (most recently admitted) | priority


@dataclass
class WorkloadConfig:
    trace: Optional[Path] = None                # resolved relative to the scenario file
    format: str = "auto"
    time_scale: float = 1.0
    limit: Optional[int] = None
    synthetic: Optional[dict[str, Any]] = None  # generator spec (see simkv.workload.synthetic)


@dataclass
class Scenario:
    name: str
    model: Any                                  # simkv.specs.ModelSpec
    gpu: Any                                    # simkv.specs.GpuSpec
    cost_model: str = "auto"                    # auto | profile | roofline | PATH
    gpu_clock: str = "auto"                     # auto: the profile's clock model, if any | fixed
    step_time_scale: float = 1.0                # multiplies every predicted step time
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    slo: dict[str, float] = field(default_factory=dict)
    path: Optional[Path] = None                 # the scenario file, when loaded from one
    base_dir: Optional[Path] = None             # relative paths resolve against this folder
    raw: dict[str, Any] = field(default_factory=dict)  # the merged YAML, for reports


# ----------------------------------------------------------------------------------------------
# Loading and validation: YAML or dict -> Scenario. Every problem is an InputError naming the
# file (or --set) and the dotted key.

SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "workload": WorkloadConfig}
TOP_LEVEL_TYPES: dict[str, tuple[type, bool]] = {
    "name": (str, False),
    "model": (str, False),
    "gpu": (str, False),
    "cost_model": (str, False),
    "gpu_clock": (str, False),
    "step_time_scale": (float, False),
    "seed": (int, False),
}
CHOICES = {
    "cache.kv_dtype": ("bf16", "fp8"),
    "cache.allocator": ("paged", "contiguous"),
    "cache.prefix_sharing_scope": ("tenant", "global"),
    "cache.preemption_mode": ("recompute", "swap"),
    "scheduler.preemption_policy": ("recent", "priority"),
    "workload.format": ("auto", "azure", "mooncake", "burstgpt", "csv"),
}
COST_MODEL_KEYWORDS = ("auto", "profile", "roofline")
GPU_CLOCK_CHOICES = ("auto", "fixed")
FREE_FORM = "workload.synthetic"    # its contents belong to the workload generator
SLO_KEY = re.compile(r"^(ttft|tpot|itl|e2e|queue)(_p\d{1,2}|_mean)?_s$")
SLO_EXAMPLES = "ttft_s, tpot_s, itl_s, e2e_s, queue_s, with _pNN or _mean before _s (ttft_p90_s)"
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NULL = ("null", "none", "~", "")


def _field_types(cls: type) -> dict[str, tuple[type, bool]]:
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
KEY_TYPES: dict[str, tuple[type, bool]] = dict(TOP_LEVEL_TYPES)
for _section, _cls in SECTIONS.items():
    KEY_TYPES.update({f"{_section}.{k}": t for k, t in _field_types(_cls).items()})
VALID_KEYS = sorted([*KEY_TYPES, *SECTIONS, "slo"])


def _suggest(key: str) -> str:
    """' (did you mean X?)' for the valid key closest to `key`, or ''."""
    close = difflib.get_close_matches(key, VALID_KEYS, n=1, cutoff=0.6)
    if not close:  # a right name in the wrong section, e.g. cache.max_num_seqs
        leaf = key.rsplit(".", 1)[-1]
        leaves = {k.rsplit(".", 1)[-1]: k for k in VALID_KEYS}
        near = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
        close = [leaves[near[0]]] if near else []
    return f" (did you mean {close[0]}?)" if close else ""


def _check_key(key: str, where: str) -> None:
    """Raise unless `key` is a settable dotted key."""
    if key in KEY_TYPES or key.startswith(FREE_FORM + ".") or key == FREE_FORM:
        return
    if key.startswith("slo."):
        if SLO_KEY.match(key[4:]):
            return
        raise InputError(f"{where}: unknown SLO key {key} (valid: {SLO_EXAMPLES})")
    raise InputError(f"{where}: unknown key {key}{_suggest(key)}")


def _type_name(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            Path: "a path", dict: "a mapping"}.get(kind, kind.__name__)


def _convert(text: str, key: str, where: str) -> Any:
    """Convert a --set string to the type of `key` (int, float, bool, str, null for Optional)."""
    if key.startswith("slo."):
        kind, optional = float, True
    elif key in KEY_TYPES:
        kind, optional = KEY_TYPES[key]
    else:  # free-form (workload.synthetic...): read the value as YAML
        try:
            return yaml.safe_load(text)
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
            value = yaml.safe_load(text)
            if not isinstance(value, dict):
                raise ValueError
            return value
    except (ValueError, yaml.YAMLError):
        null = " or null" if optional else ""
        raise InputError(
            f"{where}: {key}: expected {_type_name(kind)}{null}, got {text!r}"
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
        _check_key(key, "--set")
        out[key] = _convert(text, key, "--set")
    return out


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of the scenario dict `raw` with each dotted key of `overrides` set.

    String values are converted to the key's type, as `--set` does; other values are kept and
    type-checked later with the rest of the scenario.
    """
    merged = copy.deepcopy(raw)
    for key, value in overrides.items():
        _check_key(key, "--set")
        if isinstance(value, str):
            value = _convert(value, key, "--set")
        node = merged
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node.get(part), dict):
                if node.get(part) is not None:
                    raise InputError(f"--set {key}: {'.'.join(parts[: i + 1])} is not a mapping")
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return merged


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InputError(f"{path}: no such scenario file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a scenario YAML file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InputError(f"{path}: bad YAML{_yaml_problem(e)}") from None
    if data is None:
        raise InputError(f"{path}: empty scenario (expected a mapping with at least 'model')")
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping of scenario keys, got {type(data).__name__}")
    return data


def _yaml_problem(e: yaml.YAMLError) -> str:
    """' at line L, column C: problem' from a PyYAML error, on one line."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(e, "problem", None) or str(e)
    problem = " ".join(str(problem).split())
    if "python/" in problem:
        problem += " (only plain YAML is accepted; python/ tags are not)"
    return f"{where}: {problem}"


class _Validator:
    """Checks one scenario dict; `fail(key, msg)` names the file, or --set for overridden keys."""

    def __init__(self, source: str, overridden: set[str]):
        self.source = source
        self.overridden = overridden

    def fail(self, key: str, message: str) -> None:
        where = "--set" if key in self.overridden else self.source
        raise InputError(f"{where}: {key}: {message}")

    def unknown_keys(self, raw: dict[str, Any]) -> None:
        for key, value in raw.items():
            if key in SECTIONS:
                if value is None:
                    continue
                if not isinstance(value, dict):
                    self.fail(key, f"expected a mapping, got {value!r}")
                for sub in value:
                    _check_key(f"{key}.{sub}", self.source)
            elif key == "slo":
                if value is None:
                    continue
                if not isinstance(value, dict):
                    self.fail(key, f"expected a mapping like {{ttft_s: 1.0}}, got {value!r}")
                for sub in value:
                    _check_key(f"slo.{sub}", self.source)
            else:
                _check_key(str(key), self.source)

    def typed(self, key: str, value: Any) -> Any:
        """`value` checked against the type of `key` (ints are accepted as floats)."""
        kind, optional = KEY_TYPES[key]
        if value is None:
            if optional:
                return None
            self.fail(key, f"expected {_type_name(kind)}, got null")
        ok = {
            int: isinstance(value, int) and not isinstance(value, bool),
            float: isinstance(value, (int, float)) and not isinstance(value, bool),
            bool: isinstance(value, bool),
            str: isinstance(value, str),
            Path: isinstance(value, str),
            dict: isinstance(value, dict),
        }[kind]
        if not ok:
            self.fail(key, f"expected {_type_name(kind)}, got {value!r}")
        return float(value) if kind is float else value

    def section(self, name: str, raw: dict[str, Any]) -> Any:
        cls = SECTIONS[name]
        values = raw.get(name) or {}
        return cls(**{k: self.typed(f"{name}.{k}", v) for k, v in values.items()})

    def positive(self, key: str, value: Any, allow_zero: bool = False) -> None:
        if value is None:
            return
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            self.fail(key, f"must be {bound}, got {value}")

    def choice(self, key: str, value: str) -> None:
        if value not in CHOICES[key]:
            self.fail(key, f"{value!r} is not one of {', '.join(CHOICES[key])}")


def _resolve(text: str, base_dir: Path) -> str:
    path = Path(text).expanduser()
    return str(path if path.is_absolute() else base_dir / path)


def _looks_like_path(text: str) -> bool:
    return "/" in text or "\\" in text or text.endswith(".json")


def _check_ranges(v: _Validator, cache: CacheConfig, scheduler: SchedulerConfig,
                  workload: WorkloadConfig, seed: int) -> None:
    """Values out of range or not among their choices."""
    if cache.block_size <= 0 or cache.block_size & (cache.block_size - 1):
        v.fail("cache.block_size", f"{cache.block_size} is not a positive power of two (8, 16, 32, ...)")
    if not 0 < cache.gpu_memory_utilization <= 1:
        v.fail("cache.gpu_memory_utilization", f"{cache.gpu_memory_utilization} is not in (0, 1]")
    if not 0 <= cache.watermark < 1:
        v.fail("cache.watermark", f"{cache.watermark} is not in [0, 1)")
    v.positive("cache.memory_budget_gib", cache.memory_budget_gib)
    v.positive("cache.swap_space_gib", cache.swap_space_gib, allow_zero=True)
    v.positive("cache.num_gpu_blocks_override", cache.num_gpu_blocks_override)
    if cache.preemption_mode == "swap" and cache.swap_space_gib == 0:
        v.fail("cache.swap_space_gib", "must be > 0 when cache.preemption_mode is swap")
    v.positive("scheduler.max_num_seqs", scheduler.max_num_seqs)
    v.positive("scheduler.max_num_batched_tokens", scheduler.max_num_batched_tokens)
    v.positive("scheduler.long_prefill_token_threshold", scheduler.long_prefill_token_threshold,
               allow_zero=True)
    v.positive("scheduler.max_model_len", scheduler.max_model_len)
    v.positive("workload.time_scale", workload.time_scale)
    v.positive("workload.limit", workload.limit)
    v.positive("seed", seed, allow_zero=True)
    sections = {"cache": cache, "scheduler": scheduler, "workload": workload}
    for key in CHOICES:
        section, name = key.split(".")
        v.choice(key, getattr(sections[section], name))
    if scheduler.max_num_batched_tokens < scheduler.max_num_seqs:
        v.fail("scheduler.max_num_batched_tokens",
               f"{scheduler.max_num_batched_tokens} is smaller than scheduler.max_num_seqs "
               f"({scheduler.max_num_seqs})")


def _check_workload(v: _Validator, workload: WorkloadConfig, base_dir: Path) -> None:
    """Exactly one of a trace file (resolved against base_dir, must exist) and a generator."""
    if workload.trace is None and workload.synthetic is None:
        v.fail("workload", "set workload.trace (a trace file) or workload.synthetic (a generator)")
    if workload.trace is not None and workload.synthetic is not None:
        v.fail("workload", "set workload.trace or workload.synthetic, not both")
    if workload.trace is not None:
        workload.trace = Path(_resolve(str(workload.trace), base_dir))
        if not workload.trace.is_file():
            v.fail("workload.trace", f"no such file: {workload.trace}")


def _check_against_model(v: _Validator, scheduler: SchedulerConfig, model: Any) -> None:
    """Default max_model_len to the model's context (as vLLM does) and check the token budget."""
    if scheduler.max_model_len is None:
        scheduler.max_model_len = model.max_position_embeddings
    elif scheduler.max_model_len > model.max_position_embeddings:
        v.fail("scheduler.max_model_len",
               f"{scheduler.max_model_len} exceeds {model.name}'s max_position_embeddings "
               f"({model.max_position_embeddings})")
    if not scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens < scheduler.max_model_len:
        v.fail("scheduler.max_num_batched_tokens",
               f"{scheduler.max_num_batched_tokens} is smaller than max_model_len "
               f"({scheduler.max_model_len}) with chunked prefill off: a long prompt could never "
               "be scheduled (enable chunked prefill or lower scheduler.max_model_len)")


def load_scenario(
    path_or_dict: str | Path | dict[str, Any],
    overrides: Optional[dict[str, Any]] = None,
    *,
    base_dir: Optional[Path] = None,
    source: Optional[str] = None,
) -> Scenario:
    """Load and validate a scenario from a YAML file or a dict, applying dotted `overrides`.

    Relative paths (workload.trace, a model config path, a cost-model path) resolve against the
    scenario file's folder, or `base_dir` (default: the current folder) for a dict. Raises
    InputError with a one-line message naming the file and key on any problem.
    """
    from simkv.sizing import fit_error, size_pool  # sizing imports this module's classes
    from simkv.specs import load_gpu, load_model

    if isinstance(path_or_dict, dict):
        raw = copy.deepcopy(path_or_dict)
        path = None
        source = source or "<scenario>"
        base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
    else:
        path = Path(path_or_dict)
        raw = _read_yaml(path)
        source = source or str(path)
        base_dir = Path(base_dir) if base_dir is not None else path.resolve().parent
    overrides = dict(overrides or {})
    raw = apply_overrides(raw, overrides)
    v = _Validator(source, set(overrides))
    v.unknown_keys(raw)

    top = {k: v.typed(k, raw[k]) for k in TOP_LEVEL_TYPES if k in raw and raw[k] is not None}
    if "model" not in top:
        v.fail("model", "missing (a bundled name like llama-3.1-8b, or a path to a config.json)")
    cache = v.section("cache", raw)
    scheduler = v.section("scheduler", raw)
    workload = v.section("workload", raw)
    slo = {}
    for key, value in (raw.get("slo") or {}).items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            v.fail(f"slo.{key}", f"expected a positive number of seconds, got {value!r}")
        slo[key] = float(value)

    _check_ranges(v, cache, scheduler, workload, top.get("seed", 0))
    _check_workload(v, workload, base_dir)

    model_name = top["model"]
    try:
        model = load_model(_resolve(model_name, base_dir) if _looks_like_path(model_name) else model_name)
    except InputError as e:
        v.fail("model", str(e))
    try:
        gpu = load_gpu(top.get("gpu", "h200"))
    except InputError as e:
        v.fail("gpu", str(e))
    gpu_clock = top.get("gpu_clock", "auto")
    if gpu_clock not in GPU_CLOCK_CHOICES:
        v.fail("gpu_clock", f"{gpu_clock!r} is not one of {', '.join(GPU_CLOCK_CHOICES)}")
    step_time_scale = top.get("step_time_scale", 1.0)
    v.positive("step_time_scale", step_time_scale)
    cost_model = top.get("cost_model", "auto")
    if cost_model not in COST_MODEL_KEYWORDS:
        cost_model = _resolve(cost_model, base_dir)

    _check_against_model(v, scheduler, model)
    problem = fit_error(size_pool(model, gpu, cache, scheduler), scheduler.max_model_len)
    if problem:
        raise InputError(f"{source}: {problem}")

    return Scenario(
        name=top.get("name") or (path.stem if path else "scenario"),
        model=model,
        gpu=gpu,
        cost_model=cost_model,
        gpu_clock=gpu_clock,
        step_time_scale=step_time_scale,
        seed=top.get("seed", 0),
        cache=cache,
        scheduler=scheduler,
        workload=workload,
        slo=slo,
        path=path,
        base_dir=base_dir.resolve(),
        raw=raw,
    )


def with_overrides(scn: Scenario, overrides: dict[str, Any]) -> Scenario:
    """A new Scenario: `scn`'s merged YAML with more dotted overrides, validated again."""
    source = str(scn.path) if scn.path else None
    new = load_scenario(scn.raw, overrides, base_dir=scn.base_dir, source=source)
    new.path = scn.path
    if new.name == "scenario" and scn.path:
        new.name = scn.name
    return new


def scenario_to_dict(scn: Scenario) -> dict[str, Any]:
    """The scenario as plain JSON-serialisable data (model and GPU by name), for reports."""
    workload = asdict(scn.workload)
    workload["trace"] = str(scn.workload.trace) if scn.workload.trace is not None else None
    return {
        "name": scn.name,
        "model": scn.model.name,
        "gpu": scn.gpu.name,
        "cost_model": scn.cost_model,
        "gpu_clock": scn.gpu_clock,
        "step_time_scale": scn.step_time_scale,
        "seed": scn.seed,
        "cache": asdict(scn.cache),
        "scheduler": asdict(scn.scheduler),
        "workload": workload,
        "slo": dict(scn.slo),
        "path": str(scn.path) if scn.path else None,
    }
