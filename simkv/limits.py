"""The numeric rules: every number that enters simkv (scenario YAML, `--set`, traces, model
configs, checks files, CLI flags) is checked here, against one table.

A number is accepted when it is a real number (true/false are not numbers), finite, integral
where the rule says `int`, and inside the rule's interval. The upper bounds are what the
simulator can hold and finish (MAX_REQUESTS requests, MAX_TOKENS tokens in one request,
MAX_SECONDS of simulated time, MAX_BLOCKS blocks in a pool) or, for a memory budget, what the
GPU holds (`check_budget`); docs/fuzzing.md lists every key's largest accepted value.
Everything past these bounds is refused with one InputError naming the file (or flag) and key.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from simkv.errors import InputError

GIB = 1 << 30

MAX_TOKENS = 2**24              # tokens in one request: 64x the longest context of a bundled
                                # model (262,144), within the kernels' int32 sequence lengths
MAX_REQUESTS = 1_000_000        # requests in one workload (a trace's rows, a generator's draw)
MAX_SECONDS = 1e9               # simulated seconds (about 31.7 years): arrivals, SLOs, timers
MAX_BLOCKS = 2**23              # blocks in one pool, GPU or host (about 100 bytes each in the
                                # simulator: 8,388,608 blocks take about 0.9 GB)
MAX_SEQS = 65_536               # sequences in one step
MAX_BATCHED_TOKENS = 2**24      # tokens in one step
MAX_N = 1_024                   # samples of one request
MAX_SWAP_GIB = 4_096.0          # host swap space per GPU (and the most any budget may say)
MAX_STEP_TIME_SCALE = 10_000.0  # a step at most 10,000x the cost model's prediction (a CPU engine
                                # calibrated against a GPU profile measures hundreds)
MAX_TIME_SCALE = 1e6            # inter-arrival multiplier
MAX_RATE = 1e9                  # requests per second (1e9: a burst at one instant)
MAX_REPLICAS = 512              # replicas of one pool (simkv fleet searches up to 512)
MAX_PREFIX_IDS = 2**24          # prefix block ids a generator makes in all (about 36 bytes each)
MAX_SEED = 2**63 - 1
MAX_MODEL_INT = 2**40           # any integral field of a model's config.json
MAX_MODEL_NUMBER = 1e30         # any real field of a model's config.json (rope_theta, eps)


@dataclass(frozen=True)
class Rule:
    """A number in [low, high] (open at either end when said), an integer when `kind` is int."""
    kind: type                      # int | float
    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    unit: str = ""                  # for the message: "GiB", "seconds", "tokens"

    def interval(self) -> str:
        def show(x: float) -> str:
            if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
                x = int(x)
            return f"{x:,}" if isinstance(x, int) else f"{x:g}"
        return (("(" if self.low_open else "[") + f"{show(self.low)}, {show(self.high)}"
                + (")" if self.high_open else "]"))

    def describe(self) -> str:
        kind = "an integer" if self.kind is int else "a number"
        unit = f" of {self.unit}" if self.unit else ""
        return f"{kind}{unit} in {self.interval()}"

    def problem(self, value: Any) -> Optional[str]:
        """Why `value` breaks the rule, or None."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                and not _is_numpy_number(value):
            hint = ""
            if isinstance(value, str) and _reads_as_number(value):
                hint = " (YAML reads 1e12 as text: write 1.0e12)"
            return f"expected {self.describe()}, got {value!r}{hint}"
        if isinstance(value, float) or _is_numpy_float(value):
            if not math.isfinite(value):
                return f"{_show(value)} is not a finite number (expected {self.describe()})"
            if self.kind is int and not float(value).is_integer():
                return f"{_show(value)} is not an integer (expected {self.describe()})"
        too_low = value <= self.low if self.low_open else value < self.low
        too_high = value >= self.high if self.high_open else value > self.high
        if too_low or too_high:
            return f"{_show(value)} is not in {self.interval()} (expected {self.describe()})"
        return None


def _reads_as_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_numpy_number(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") \
        and value.dtype.kind in "iuf"


def _is_numpy_float(value: Any) -> bool:
    return type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None \
        and value.dtype.kind == "f"


def _show(value: Any) -> str:
    if isinstance(value, float) or _is_numpy_float(value):
        value = float(value)
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:g}" if abs(value) >= 1e15 else repr(value)
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _r(kind, low, high, low_open=False, high_open=False, unit=""):
    return Rule(kind, low, high, low_open, high_open, unit)


# --- the table ---------------------------------------------------------------------------------
# Shared shapes
TOKENS = _r(int, 1, MAX_TOKENS, unit="tokens")
TOKENS_OR_ZERO = _r(int, 0, MAX_TOKENS, unit="tokens")
SECONDS = _r(float, 0, MAX_SECONDS, unit="seconds")
POSITIVE_SECONDS = _r(float, 0, MAX_SECONDS, low_open=True, unit="seconds")
FRACTION = _r(float, 0, 1)
WEIGHT = _r(float, 0, 1e6)
REQUESTS = _r(int, 1, MAX_REQUESTS, unit="requests")
SAMPLES = _r(int, 1, MAX_N)
COUNT = _r(int, 1, 1_000_000)

# Every numeric scenario key (dotted, as `--set` names it) and its rule. cluster.pools.N.cache.*
# and .scheduler.* take the rules of cache.* and scheduler.*.
RULES: dict[str, Rule] = {
    "step_time_scale": _r(float, 0, MAX_STEP_TIME_SCALE, low_open=True),
    "cost_model.step_time_scale": _r(float, 0, MAX_STEP_TIME_SCALE, low_open=True),
    "cost_model.expert_skew": _r(float, 0, 10),
    "seed": _r(int, 0, MAX_SEED),
    "tensor_parallel_size": _r(int, 1, 16),         # simkv.parallel.MAX_TENSOR_PARALLEL_SIZE
    "cache.block_size": _r(int, 1, 1024, unit="tokens"),
    "cache.gpu_memory_utilization": _r(float, 0, 1, low_open=True),
    "cache.memory_budget_gib": _r(float, 0, MAX_SWAP_GIB, low_open=True, unit="GiB"),
    "cache.watermark": _r(float, 0, 1, high_open=True),
    "cache.swap_space_gib": _r(float, 0, MAX_SWAP_GIB, unit="GiB"),
    "cache.num_gpu_blocks_override": _r(int, 1, MAX_BLOCKS, unit="blocks"),
    "scheduler.max_num_seqs": _r(int, 1, MAX_SEQS),
    "scheduler.max_num_batched_tokens": _r(int, 1, MAX_BATCHED_TOKENS, unit="tokens"),
    "scheduler.long_prefill_token_threshold": TOKENS_OR_ZERO,
    "scheduler.max_model_len": TOKENS,
    "scheduler.max_loras": _r(int, 1, MAX_SEQS),
    "scheduler.admission_delay_s": _r(float, 0, 1, unit="seconds"),
    "scheduler.output_delay_s": _r(float, 0, 1, unit="seconds"),
    "scheduler.output_delay_per_running_s": _r(float, 0, 0.01, unit="seconds"),
    "workload.time_scale": _r(float, 0, MAX_TIME_SCALE, low_open=True),
    "workload.limit": REQUESTS,
    "workload.offset": _r(int, 0, 10**9, unit="requests"),
    "workload.prompt_scale": _r(float, 0, 1000, low_open=True),
    "workload.output_scale": _r(float, 0, 1000, low_open=True),
    "slo": POSITIVE_SECONDS,                          # every slo.* key
    "cluster.router.refresh_s": SECONDS,
    "cluster.router.seed": _r(int, 0, MAX_SEED),
    "cluster.router.prefix_blocks": COUNT,
    "cluster.router.load_factor": _r(float, 1, 1e6),
    "cluster.router.virtual_nodes": _r(int, 1, 100_000),
    "cluster.router.prefix_weight": WEIGHT,
    "cluster.router.queue_weight": WEIGHT,
    "cluster.router.kv_weight": WEIGHT,
    "cluster.pools.replicas": _r(int, 1, MAX_REPLICAS),
    "cluster.kv_transfer.bandwidth_gbps": _r(float, 0, 1e6, low_open=True, unit="Gb/s"),
    "cluster.kv_transfer.latency_s": _r(float, 0, 3600, unit="seconds"),
    # workload.synthetic (simkv.workload.synthetic); lengths use TOKENS, seconds SECONDS
    "workload.synthetic.num_requests": REQUESTS,
    "workload.synthetic.duration_s": POSITIVE_SECONDS,
    "workload.synthetic.arrival.rate": _r(float, 0, MAX_RATE, low_open=True,
                                          unit="requests per second"),
    "workload.synthetic.arrival.cv": _r(float, 0, 100, low_open=True),
    "workload.synthetic.cancel_fraction": FRACTION,
    "workload.synthetic.cancel_max_s": POSITIVE_SECONDS,
    "workload.synthetic.tenants": COUNT,
    "workload.synthetic.shared_prefix.num_groups": COUNT,
    "workload.synthetic.shared_prefix.prefix_tokens": TOKENS,
    "workload.synthetic.shared_prefix.fraction": FRACTION,
    "workload.synthetic.shared_prefix.block_tokens": _r(int, 1, 1_000_000, unit="tokens"),
    "lengths": TOKENS,                       # any token-length distribution's value/min/max/mean
    "lognormal.sigma": _r(float, 0, 10),
    "n": SAMPLES,                            # samples of a request (generator and trace)
    "turns": _r(int, 1, 10_000),             # workload.synthetic.conversation.turns
    # trace rows (simkv.workload.trace_formats): token counts (a format may drop 0-token
    # rows; the canonical CSV needs >= 1), seconds (arrivals, cancel_after_s)
    "trace.tokens": TOKENS_OR_ZERO,
    "trace.seconds": SECONDS,
    # a model's config.json (simkv.specs)
    "model.int": _r(int, 0, MAX_MODEL_INT),
    "model.number": _r(float, 0, MAX_MODEL_NUMBER, low_open=True),
    # checks files: a bound compared with a summary value
    "check.bound": _r(float, -1e300, 1e300),
    # flags of the commands that are not scenario keys
    "--replicates": _r(int, 1, 1_000),
    "--tolerance": _r(float, 0, 1, low_open=True, high_open=True),
    "--workers": _r(int, 1, 1_024),
    "--rate": _r(float, 0, MAX_RATE, low_open=True, unit="requests per second"),
    "--gpu-price": _r(float, 0, 1e6, unit="USD per hour"),
    "--gpu-budget": _r(int, 1, 100_000),
    "--step": _r(int, 1, 2**62),
}


def rule_for(key: str) -> Optional[Rule]:
    """The rule of a dotted scenario key (cluster pools by index; every slo.* key), or None."""
    if key.startswith("slo."):
        return RULES["slo"]
    parts = key.split(".")
    if len(parts) >= 3 and parts[:2] == ["cluster", "pools"] and parts[2].isdigit():
        rest = parts[3:]
        if rest == ["replicas"]:
            return RULES["cluster.pools.replicas"]
        return RULES.get(".".join(rest))
    return RULES.get(key)


def check_number(value: Any, rule: Rule | str, name: str, where: Optional[str] = None):
    """`value` as an int or float if it keeps `rule` (a Rule or a RULES key); else InputError
    '<where>: <name>: <why>' (`where`: the file, row or flag; `name`: the key)."""
    if isinstance(rule, str):
        rule = RULES[rule]
    problem = rule.problem(value)
    if problem is not None:
        prefix = f"{where}: " if where else ""
        raise InputError(f"{prefix}{name}: {problem}")
    if rule.kind is int:
        return int(value)
    return float(value)


def budget_problem(budget_gib: Optional[float], gpu_name: str, memory_bytes: int) -> Optional[str]:
    """Why a memory budget (GiB) does not fit on the GPU (more than its memory, per GPU), or
    None."""
    if budget_gib is None or budget_gib * GIB <= memory_bytes:
        return None
    return (f"{_show(float(budget_gib))} GiB is more than {gpu_name}'s memory "
            f"({memory_bytes / GIB:,.2f} GiB per GPU); the budget must fit on the GPU")


def blocks_problem(num_blocks: int, what: str) -> Optional[str]:
    """Why a pool of `num_blocks` blocks is more than the simulator holds (MAX_BLOCKS), or
    None."""
    if num_blocks <= MAX_BLOCKS:
        return None
    return (f"the {what} would hold {num_blocks:,} blocks, more than the simulator holds "
            f"({MAX_BLOCKS:,}); use larger blocks (cache.block_size) or a smaller {what}")
