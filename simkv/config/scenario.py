"""Scenario configuration: the typed Scenario and `load_scenario`, YAML or dict -> Scenario.

The settable sections are in `sections`, the dotted keys and --set conversion in `keys`, the
YAML reading in `yaml_file` and the value checks in `validate`; every problem is an InputError
naming the file (or --set) and the dotted key. The core trusts a Scenario once it is built.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from simkv.config.keys import (EFFECTS, FREE_FORM, KEY_TYPES, SECTIONS, SLO_EXAMPLES, SLO_KEY,
                               TOP_LEVEL_TYPES, VALID_KEYS, apply_overrides, parse_set)
from simkv import parallel
from simkv import semantics as rules
from simkv.config.cluster import ClusterConfig, cluster_to_dict, load_cluster
from simkv.config.sections import CacheConfig, SchedulerConfig, WorkloadConfig
from simkv.config.validate import (CHOICES, COST_MODEL_KEYWORDS, GPU_CLOCK_CHOICES, Validator,
                                   check_against_model, check_hardware, check_ranges,
                                   check_workload, looks_like_path, resolve_path)
from simkv.config.yaml_file import read_yaml
from simkv.errors import InputError
from simkv.kv_geometry import effective_block_size
from simkv.sizing import fit_error, size_pool
from simkv.specs import load_gpu, load_model

# Names importable from here as before the split (`from simkv.config.scenario import ...`).
__all__ = ["CHOICES", "COST_MODEL_KEYWORDS", "CacheConfig", "FREE_FORM", "GPU_CLOCK_CHOICES",
           "KEY_TYPES", "SECTIONS", "SLO_EXAMPLES", "SLO_KEY", "Scenario", "SchedulerConfig",
           "TOP_LEVEL_TYPES", "VALID_KEYS", "WorkloadConfig", "apply_overrides",
           "load_scenario", "parse_set", "scenario_to_dict", "with_overrides"]


@dataclass
class Scenario:
    name: str
    model: Any                                  # simkv.specs.ModelSpec
    gpu: Any                                    # simkv.specs.GpuSpec
    cost_model: str = "auto"                    # auto | profile | roofline | PATH
    gpu_clock: str = "auto"                     # auto: the profile's clock model, if any | fixed
    step_time_scale: float = 1.0                # multiplies every predicted step time
    effects: tuple = EFFECTS                    # the cost model's layers on the fitted forward
    expert_skew: float = 0.0                    # roofline: MoE routing skew (0 = uniform)
    seed: int = 0
    semantics: str = rules.DEFAULT_SEMANTICS    # vllm-0.26 | vllm-0.18 (simkv.semantics)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    slo: dict[str, float] = field(default_factory=dict)
    path: Optional[Path] = None                 # the scenario file, when loaded from one
    base_dir: Optional[Path] = None             # relative paths resolve against this folder
    raw: dict[str, Any] = field(default_factory=dict)  # the merged YAML, for reports
    cluster: Optional[ClusterConfig] = None     # pools behind a router; None: one replica
    tensor_parallel_size: int = 1               # GPUs per replica (simkv.parallel)


def _read_source(path_or_dict, base_dir: Optional[Path], source: Optional[str]) -> tuple:
    """(raw dict, scenario file or None, source name for messages, base folder)."""
    if isinstance(path_or_dict, dict):
        raw = copy.deepcopy(path_or_dict)
        path = None
        source = source or "<scenario>"
        base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
    else:
        path = Path(path_or_dict)
        raw = read_yaml(path)
        source = source or str(path)
        base_dir = Path(base_dir) if base_dir is not None else path.resolve().parent
    return raw, path, source, base_dir


def _slo(v: Validator, raw: dict[str, Any]) -> dict[str, float]:
    """The `slo:` targets in seconds (null entries left out)."""
    slo = {}
    for key, value in (raw.get("slo") or {}).items():
        if value is None:
            continue
        slo[key] = v.number(f"slo.{key}", value)
    return slo


def _model_and_gpu(v: Validator, top: dict[str, Any], base_dir: Path) -> tuple:
    """The ModelSpec (a bundled name, or a config path resolved against base_dir) and GpuSpec."""
    model_name = top["model"]
    try:
        model = load_model(resolve_path(model_name, base_dir) if looks_like_path(model_name)
                           else model_name, weights_dtype=top.get("weights_dtype"))
    except InputError as e:
        text = str(e)
        if text.startswith("weights_dtype: "):
            v.fail("weights_dtype", text[len("weights_dtype: "):])
        v.fail("model", text)
    try:
        gpu = load_gpu(top.get("gpu", "h200"))
    except InputError as e:
        v.fail("gpu", str(e))
    return model, gpu


def _runtime_settings(v: Validator, top: dict[str, Any], raw: dict[str, Any],
                      base_dir: Path) -> tuple:
    """(gpu_clock, step_time_scale, cost_model, effects) checked; a cost-model path resolved.
    `cost_model:` is its source, or {source, effects, step_time_scale}; `gpu_clock: fixed`
    takes the clock out of the effects."""
    gpu_clock = top.get("gpu_clock", "auto")
    if gpu_clock not in GPU_CLOCK_CHOICES:
        v.fail("gpu_clock", f"{gpu_clock!r} is not one of {', '.join(GPU_CLOCK_CHOICES)}")
    step_time_scale = top.get("step_time_scale", 1.0)
    cost_model, effects = top.get("cost_model", "auto"), list(EFFECTS)
    settings = raw.get("cost_model")
    if isinstance(settings, dict):
        cost_model = v.typed("cost_model.source", settings.get("source", "auto"))
        if settings.get("effects") is not None:
            effects = v.typed("cost_model.effects", settings["effects"])
        if settings.get("step_time_scale") is not None:
            if "step_time_scale" in top:
                v.fail("cost_model.step_time_scale", "set it here or at the top level, not both")
            step_time_scale = v.typed("cost_model.step_time_scale", settings["step_time_scale"])
    unknown = [e for e in effects if e not in EFFECTS]
    if unknown or len(set(effects)) != len(effects):
        v.fail("cost_model.effects", f"{effects!r}: each at most once, of {', '.join(EFFECTS)} "
               "([] for the plain fitted forward time)")
    if gpu_clock == "fixed":
        effects = [e for e in effects if e != "clock"]
    if cost_model not in COST_MODEL_KEYWORDS:
        cost_model = resolve_path(cost_model, base_dir)
    return gpu_clock, step_time_scale, cost_model, tuple(e for e in EFFECTS if e in effects)


def _expert_skew(v: Validator, raw: dict[str, Any]) -> float:
    """`cost_model.expert_skew`: the roofline's MoE routing skew (0 = uniform routing)."""
    settings = raw.get("cost_model")
    if not isinstance(settings, dict) or settings.get("expert_skew") is None:
        return 0.0
    return v.typed("cost_model.expert_skew", settings["expert_skew"])


def _check_kv_groups(v: Validator, model, gpu, cache, scheduler) -> None:
    """The block size vLLM runs the model with (as vLLM's config does it, in place: MLA on Hopper,
    linear-attention hybrids; simkv.kv_geometry), and the features a hybrid's KV groups lack."""
    cache.block_size = effective_block_size(model, gpu.name, cache.block_size,
                                            scheduler.max_model_len)
    if not model.is_hybrid:
        return
    if cache.allocator == "contiguous":
        v.fail("cache.allocator", f"{model.name} keeps KV in several groups (hybrid); only the "
               "paged allocator models them")
    if scheduler.parallel_sampling == "fork":
        v.fail("scheduler.parallel_sampling", f"{model.name} keeps KV in several groups "
               "(hybrid); forked samples are not modelled for them: use fanout (vllm-0.26)")


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
    raw, path, source, base_dir = _read_source(path_or_dict, base_dir, source)
    overrides = dict(overrides or {})
    raw = apply_overrides(raw, overrides)
    v = Validator(source, set(overrides))
    v.unknown_keys(raw)

    top = {k: v.typed(k, raw[k]) for k in TOP_LEVEL_TYPES if k in raw and raw[k] is not None
           and not (k == "cost_model" and isinstance(raw[k], dict))}
    if "model" not in top:
        v.fail("model", "missing (a bundled name like llama-3.1-8b, or a path to a config.json)")
    cache = v.section("cache", raw)
    scheduler = v.section("scheduler", raw)
    workload = v.section("workload", raw)
    slo = _slo(v, raw)
    model, gpu = _model_and_gpu(v, top, base_dir)
    semantics = top.get("semantics", rules.DEFAULT_SEMANTICS)
    if semantics not in rules.SEMANTICS:
        v.fail("semantics", f"{semantics!r} is not one of {', '.join(rules.SEMANTICS)}")
    rules.resolve(semantics, cache, scheduler, gpu)
    check_ranges(v, cache, scheduler, workload, top.get("seed", 0))
    check_workload(v, workload, base_dir)
    gpu_clock, step_time_scale, cost_model, effects = _runtime_settings(v, top, raw, base_dir)
    check_against_model(v, scheduler, model)
    tp = top.get("tensor_parallel_size", 1)
    problem = parallel.check(model, tp)
    if problem:
        v.fail("tensor_parallel_size", problem)
    _check_kv_groups(v, model, gpu, cache, scheduler)
    check_hardware(v, cache, gpu)
    problem = fit_error(size_pool(model, gpu, cache, scheduler, tp), scheduler.max_model_len)
    if problem:
        raise InputError(f"{source}: {problem}")
    name = top.get("name") or (path.stem if path else "scenario")

    def load_pool(pool_raw: dict, pool_source: str) -> Scenario:
        pool = load_scenario(pool_raw, base_dir=base_dir, source=pool_source)
        pool.name, pool.path = name, path
        return pool

    cluster = load_cluster(raw, v, source, load_pool)

    return Scenario(
        name=name,
        model=model,
        gpu=gpu,
        cost_model=cost_model,
        gpu_clock=gpu_clock,
        step_time_scale=step_time_scale,
        effects=effects,
        expert_skew=_expert_skew(v, raw),
        seed=top.get("seed", 0),
        semantics=semantics,
        cache=cache,
        scheduler=scheduler,
        workload=workload,
        slo=slo,
        path=path,
        base_dir=base_dir.resolve(),
        raw=raw,
        cluster=cluster,
        tensor_parallel_size=tp,
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
        "effects": list(scn.effects),
        "expert_skew": scn.expert_skew,
        "seed": scn.seed,
        "semantics": scn.semantics,
        "cache": asdict(scn.cache),
        "scheduler": asdict(scn.scheduler),
        "workload": workload,
        "slo": dict(scn.slo),
        "path": str(scn.path) if scn.path else None,
        **({"cluster": cluster_to_dict(scn.cluster)} if scn.cluster is not None else {}),
        **({"tensor_parallel_size": scn.tensor_parallel_size}
           if scn.tensor_parallel_size != 1 else {}),
    }
