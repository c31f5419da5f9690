"""Checking a scenario's values: types, ranges (every number by the table of simkv.limits),
choices, the workload source and the limits the model and the GPU set. Every problem is an
InputError naming the file (or --set) and the dotted key."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from simkv.config.keys import KEY_TYPES, SECTIONS, check_key, type_name
from simkv.config.sections import CacheConfig, SchedulerConfig, WorkloadConfig
from simkv.errors import InputError
from simkv.limits import budget_problem, rule_for
from simkv.specs import KV_DTYPE_ALIASES, kv_dtype_name

CHOICES = {
    "cache.kv_dtype": ("bf16", "fp8"),
    "cache.allocator": ("paged", "contiguous"),
    "cache.prefix_sharing_scope": ("tenant", "global"),
    "cache.preemption_mode": ("recompute", "swap"),
    "cache.pool_sizing": ("vllm", "engine"),
    "scheduler.preemption_policy": ("recent", "priority"),
    "scheduler.policy": ("fcfs", "priority"),
    "scheduler.parallel_sampling": ("fanout", "fork"),
    "workload.format": ("auto", "azure", "mooncake", "burstgpt", "csv"),
    "workload.resample": (None, "bootstrap"),
}
COST_MODEL_KEYWORDS = ("auto", "profile", "roofline")
GPU_CLOCK_CHOICES = ("auto", "fixed")


class Validator:
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
                    check_key(f"{key}.{sub}", self.source)
            elif key == "cost_model" and isinstance(value, dict):
                for sub in value:
                    check_key(f"cost_model.{sub}", self.source)
            elif key == "cluster":
                continue              # simkv.config.cluster checks its own keys
            elif key == "slo":
                if value is None:
                    continue
                if not isinstance(value, dict):
                    self.fail(key, f"expected a mapping like {{ttft_s: 1.0}}, got {value!r}")
                for sub in value:
                    check_key(f"slo.{sub}", self.source)
            else:
                check_key(str(key), self.source)

    def typed(self, key: str, value: Any, kind_optional: tuple | None = None) -> Any:
        """`value` checked against the type of `key` (ints are accepted as floats) and, for a
        number, against its rule in simkv.limits (finite, integral, in range)."""
        kind, optional = kind_optional or KEY_TYPES[key]
        if value is None:
            if optional:
                return None
            self.fail(key, f"expected {type_name(kind)}, got null")
        ok = {
            int: isinstance(value, int) and not isinstance(value, bool),
            float: isinstance(value, (int, float)) and not isinstance(value, bool),
            bool: isinstance(value, bool),
            str: isinstance(value, str),
            Path: isinstance(value, str),
            dict: isinstance(value, dict),
            list: isinstance(value, list),
        }[kind]
        if not ok:
            hint = ""
            if kind in (int, float) and isinstance(value, str):
                hint = rule_for(key).problem(value).rpartition(value.__repr__())[2]
            self.fail(key, f"expected {type_name(kind)}, got {value!r}{hint}")
        if kind in (int, float):
            return self.number(key, value)
        return value

    def number(self, key: str, value: Any) -> Any:
        """`value` checked against the rule of `key` (simkv.limits.RULES), as int or float."""
        rule = rule_for(key)
        if rule is None:
            raise AssertionError(f"{key}: a numeric key without a rule in simkv.limits.RULES")
        problem = rule.problem(value)
        if problem is not None:
            self.fail(key, problem)
        return int(value) if rule.kind is int else float(value)

    def section(self, name: str, raw: dict[str, Any]) -> Any:
        cls = SECTIONS[name]
        values = raw.get(name) or {}
        return cls(**{k: self.typed(f"{name}.{k}", v) for k, v in values.items()})

    def choice(self, key: str, value: str) -> None:
        if value not in CHOICES[key]:
            names = ", ".join("null" if c is None else c for c in CHOICES[key])
            also = f" (or vLLM's {', '.join(KV_DTYPE_ALIASES)})" if key == "cache.kv_dtype" else ""
            self.fail(key, f"{value!r} is not one of {names}{also}")


def resolve_path(text: str, base_dir: Path) -> str:
    """`text` as a path, relative ones resolved against `base_dir`."""
    path = Path(text).expanduser()
    return str(path if path.is_absolute() else base_dir / path)


def looks_like_path(text: str) -> bool:
    """Whether a model name is a path to a config (a bundled name has no slash and no .json)."""
    return "/" in text or "\\" in text or text.endswith(".json")


def check_ranges(v: Validator, cache: CacheConfig, scheduler: SchedulerConfig,
                  workload: WorkloadConfig, seed: int) -> None:
    """Values not among their choices, and the rules between keys (each number alone was
    checked against simkv.limits as it was read: `Validator.typed`)."""
    if cache.block_size & (cache.block_size - 1):
        v.fail("cache.block_size", f"{cache.block_size} is not a positive power of two (8, 16, 32, ...)")
    if cache.preemption_mode == "swap" and cache.swap_space_gib == 0:
        v.fail("cache.swap_space_gib", "must be > 0 when cache.preemption_mode is swap")
    if workload.model_filter is not None and (
            not workload.model_filter or not all(isinstance(m, str) for m in workload.model_filter)):
        v.fail("workload.model_filter", "must be a non-empty list of BurstGPT Model names, e.g. "
                                        "[ChatGPT]")
    cache.kv_dtype = kv_dtype_name(cache.kv_dtype)      # vLLM's names too (fp8_e4m3, auto)
    sections = {"cache": cache, "scheduler": scheduler, "workload": workload}
    for key in CHOICES:
        section, name = key.split(".")
        v.choice(key, getattr(sections[section], name))
    if scheduler.async_scheduling:
        # vLLM v1, the only one that schedules asynchronously, neither forks nor swaps
        if scheduler.parallel_sampling != "fanout":
            v.fail("scheduler.parallel_sampling",
                   f"{scheduler.parallel_sampling!r} with scheduler.async_scheduling true: "
                   "asynchronous scheduling needs fanout (vLLM v1 has no forks)")
        if cache.preemption_mode != "recompute":
            v.fail("cache.preemption_mode",
                   f"{cache.preemption_mode!r} with scheduler.async_scheduling true: "
                   "asynchronous scheduling needs recompute (vLLM v1 has no swap)")
    if scheduler.max_num_batched_tokens < scheduler.max_num_seqs:
        v.fail("scheduler.max_num_batched_tokens",
               f"{scheduler.max_num_batched_tokens} is smaller than scheduler.max_num_seqs "
               f"({scheduler.max_num_seqs})")


def check_workload(v: Validator, workload: WorkloadConfig, base_dir: Path) -> None:
    """Exactly one of a trace file (resolved against base_dir, must exist) and a generator."""
    if workload.trace is None and workload.synthetic is None:
        v.fail("workload", "set workload.trace (a trace file) or workload.synthetic (a generator)")
    if workload.trace is not None and workload.synthetic is not None:
        v.fail("workload", "set workload.trace or workload.synthetic, not both")
    if workload.trace is not None:
        workload.trace = Path(resolve_path(str(workload.trace), base_dir))
        if not workload.trace.is_file():
            v.fail("workload.trace", f"no such file: {workload.trace}")


def check_against_model(v: Validator, scheduler: SchedulerConfig, model: Any) -> None:
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




def check_hardware(v: Validator, cache: CacheConfig, gpu: Any) -> None:
    """A budget is at most the GPU's memory (per GPU). (The pool's blocks are bounded where
    a pool is built: simkv.engine.build.)"""
    problem = budget_problem(cache.memory_budget_gib, gpu.name, gpu.memory_bytes)
    if problem:
        v.fail("cache.memory_budget_gib", problem)
