"""Synthetic workloads: seeded generators that produce the canonical trace frame.

A spec is the scenario's `workload.synthetic` mapping:

    num_requests: 1000            # or duration_s: 600 (arrivals in [0, duration_s))
    arrival: {process: poisson, rate: 10}   # poisson | gamma (+ cv; cv > 1 bursty) | fixed
    prompt_tokens: {dist: lognormal, mean: 1000, sigma: 1.0, max: 8192}
    output_tokens: {dist: fixed, value: 200}       # or a bare integer
    shared_prefix: {num_groups: 4, prefix_tokens: 500, fraction: 0.5, block_tokens: 16}
    n: 1                                           # or a length distribution
    cancel_fraction: 0.1                           # cancel_after_s ~ uniform [0, cancel_max_s]
    cancel_max_s: 5.0
    tenants: 3                                     # "t0".."t2", uniformly
    conversation: {turns: 4, think_time_s: {dist: exponential, mean: 30}, new_tokens: 150}

With `conversation`, the arrivals, `prompt_tokens`, `shared_prefix` and `tenants` are those of
each conversation's first turn; every turn after it is a request that continues the one before
(`parent_request_id`): its prompt is the previous turn's prompt + output + `new_tokens` (a
length distribution, the user's next message), and it arrives `think_time_s` after the previous
turn arrived (a number, or `{dist: fixed, value}`, `{dist: uniform, min, max}`,
`{dist: exponential, mean}`, `{dist: lognormal, mean, sigma}`, in seconds >= 0; the time the
answer takes is inside it, so a turn can arrive before the previous answer is complete).
`turns` (an integer or a length distribution) counts the requests of a conversation, the
first included. `output_tokens`, `n` and cancellations are drawn per request. The frame holds
every turn, in arrival order.

Length distributions: `{dist: fixed, value}`, `{dist: uniform, min, max}` (inclusive),
`{dist: lognormal, mean, sigma, min?, max?}` (mean of the distribution, not its median; sigma in
log space; rounded and clipped to [min (default 1), max]), `{dist: empirical, trace, column?,
format?}` (resampled with replacement from a trace, the path relative to `base_dir`).

Each feature draws from its own stream spawned from `numpy.random.default_rng(seed)`, so turning
on cancellations, say, leaves the arrivals and lengths of the same seed unchanged.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.workload.traces import FORMATS, build_trace, load_trace
from simkv.errors import InputError
from simkv.limits import MAX_PREFIX_IDS, MAX_REQUESTS, RULES, Rule, check_number

WHERE = "workload.synthetic"
SPEC_KEYS = ["num_requests", "duration_s", "arrival", "prompt_tokens", "output_tokens",
             "shared_prefix", "n", "cancel_fraction", "cancel_max_s", "tenants", "conversation"]
CONVERSATION_KEYS = ["turns", "think_time_s", "new_tokens"]
SECONDS_KEYS = {"fixed": ["value"], "uniform": ["min", "max"], "exponential": ["mean"],
                "lognormal": ["mean", "sigma"]}
DIST_KEYS = {"fixed": ["value"], "uniform": ["min", "max"],
             "lognormal": ["mean", "sigma", "min", "max"],
             "empirical": ["trace", "column", "format"]}
ARRIVAL_KEYS = {"poisson": ["rate"], "gamma": ["rate", "cv"], "fixed": ["rate"]}
SHARED_PREFIX_KEYS = ["num_groups", "prefix_tokens", "fraction", "block_tokens"]
_MISSING = object()


def generate_synthetic(spec: dict, seed: int, base_dir: Path | None = None) -> pd.DataFrame:
    """Generate a synthetic workload as the canonical trace frame (see `simkv.workload.traces`).

    Arrivals are in seconds from the first request (at 0.0), lengths in tokens. Requests with a
    shared system prompt carry chained `prefix_ids` at `block_tokens` granularity; the others
    have none. Same spec and seed give an identical frame. Raises InputError naming
    `workload.synthetic.<key>` for any bad key or value.
    """
    if not isinstance(spec, dict):
        raise InputError(f"{WHERE} must be a mapping with keys {', '.join(SPEC_KEYS)}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"seed must be an integer >= 0, got {seed!r}")
    _check_keys(spec, SPEC_KEYS, WHERE)
    base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
    # spawn(8)'s first seven streams are spawn(7)'s: a spec without `conversation` draws as before
    arrival_rng, prompt_rng, output_rng, prefix_rng, n_rng, cancel_rng, tenant_rng, turn_rng = \
        np.random.default_rng(seed).spawn(8)

    arrival_s = _arrivals(spec, arrival_rng)
    starts = len(arrival_s)           # requests, or conversations with `conversation`
    turns = None
    if spec.get("conversation") is not None:
        turns, new_tokens, think_s = _turns(spec["conversation"], starts, turn_rng, base_dir)
    count = starts if turns is None else int(turns.sum())
    if count > MAX_REQUESTS:
        raise InputError(f"{WHERE}.conversation.turns: {count:,} requests in all, more than "
                         f"the simulator takes ({MAX_REQUESTS:,}); fewer conversations or turns")
    columns = {
        "arrival_s": arrival_s,
        "prompt_tokens": _lengths(_get(spec, "prompt_tokens", WHERE), starts, prompt_rng,
                                  f"{WHERE}.prompt_tokens", base_dir),
        "output_tokens": _lengths(_get(spec, "output_tokens", WHERE), count, output_rng,
                                  f"{WHERE}.output_tokens", base_dir),
    }
    if spec.get("shared_prefix") is not None:
        columns.update(_shared_prefix(spec["shared_prefix"], columns["prompt_tokens"],
                                      prefix_rng))
    if spec.get("tenants") is not None:
        tenants = _integer(spec, "tenants", WHERE)
        columns["tenant"] = np.char.add("t", tenant_rng.integers(0, tenants, starts).astype(str))
    if turns is not None:
        columns = _conversations(columns, turns, new_tokens, think_s)
    if spec.get("n") is not None:
        columns["n"] = _lengths(spec["n"], count, n_rng, f"{WHERE}.n", base_dir)
    fraction = _number(spec, "cancel_fraction", WHERE, default=0.0)
    max_s = _number(spec, "cancel_max_s", WHERE, default=5.0)
    if fraction > 0:
        cancel_after_s = np.full(count, np.nan)
        chosen = _choose(cancel_rng, count, fraction)
        cancel_after_s[chosen] = cancel_rng.uniform(0.0, max_s, len(chosen))
        columns["cancel_after_s"] = cancel_after_s
    return build_trace(columns, source=f"synthetic (seed {seed})", format="synthetic")


def _arrivals(spec: dict, rng: np.random.Generator) -> np.ndarray:
    """Arrival times in seconds, the first at 0.0."""
    if (spec.get("num_requests") is None) == (spec.get("duration_s") is None):
        raise InputError(f"{WHERE}: give exactly one of num_requests or duration_s")
    where = f"{WHERE}.arrival"
    arrival = _get(spec, "arrival", WHERE)
    if not isinstance(arrival, dict):
        raise InputError(f"{where} must be a mapping like {{process: poisson, rate: 10}}")
    process = arrival.get("process", "poisson")
    if process not in ARRIVAL_KEYS:
        raise InputError(f"{where}.process must be one of {', '.join(ARRIVAL_KEYS)}, "
                         f"got {process!r}")
    _check_keys(arrival, ["process"] + ARRIVAL_KEYS[process], where)
    rate = _number(arrival, "rate", where, positive=True)
    if process == "poisson":
        def gaps(k): return rng.exponential(1.0 / rate, k)
    elif process == "gamma":
        # shape 1/cv^2 and mean 1/rate give inter-arrival times with exactly that CV
        shape = 1.0 / _number(arrival, "cv", where, positive=True) ** 2
        def gaps(k): return rng.gamma(shape, 1.0 / (rate * shape), k)
    else:
        def gaps(k): return np.full(k, 1.0 / rate)

    if spec.get("num_requests") is not None:
        count = _integer(spec, "num_requests", WHERE)
        return np.concatenate([[0.0], np.cumsum(gaps(count - 1))])
    duration_s = _number(spec, "duration_s", WHERE, positive=True)
    if rate * duration_s > MAX_REQUESTS:
        raise InputError(f"{WHERE}.duration_s: {duration_s:g} s at {where}.rate {rate:g}/s is "
                         f"about {rate * duration_s:,.0f} requests, more than the simulator "
                         f"takes ({MAX_REQUESTS:,}); shorten it or lower the rate")
    chunk = int(rate * duration_s) + 16
    drawn = gaps(chunk)
    while drawn.sum() < duration_s:
        drawn = np.concatenate([drawn, gaps(chunk)])
    arrival_s = np.concatenate([[0.0], np.cumsum(drawn)])
    return arrival_s[arrival_s < duration_s]


def _lengths(dist, count: int, rng: np.random.Generator, where: str,
             base_dir: Path) -> np.ndarray:
    """Draw `count` integers >= 1 from a length distribution spec (or a bare integer), each
    within the rule of what they count (tokens, samples, turns: simkv.limits)."""
    rule = _length_rule(where)
    if not isinstance(dist, dict):
        if isinstance(dist, bool) or not isinstance(dist, (int, np.integer)):
            raise InputError(f"{where}: expected an integer or a mapping like "
                             f"{{dist: fixed, value: 200}}, got {dist!r}")
        return np.full(count, check_number(dist, rule, where), dtype=np.int64)
    kind = dist.get("dist")
    if kind not in DIST_KEYS:
        raise InputError(f"{where}.dist must be one of {', '.join(DIST_KEYS)}, got {kind!r}")
    _check_keys(dist, ["dist"] + DIST_KEYS[kind], where)
    if kind == "fixed":
        return np.full(count, _integer(dist, "value", where, rule=rule), dtype=np.int64)
    if kind == "uniform":
        low = _integer(dist, "min", where, rule=rule)
        high = _integer(dist, "max", where, rule=rule)
        if high < low:
            raise InputError(f"{where}.max must be >= {where}.min ({low}), got {high}")
        return rng.integers(low, high + 1, count, dtype=np.int64)
    if kind == "lognormal":
        mean = _number(dist, "mean", where, rule=Rule(float, 0, rule.high, low_open=True))
        sigma = _number(dist, "sigma", where, rule=RULES["lognormal.sigma"])
        low = _integer(dist, "min", where, default=1, rule=rule)
        high = _integer(dist, "max", where, default=None, rule=rule)
        if high is not None and high < low:
            raise InputError(f"{where}.max must be >= {where}.min ({low}), got {high}")
        mu = math.log(mean) - sigma ** 2 / 2  # so that the mean, not the median, is `mean`
        values = np.rint(rng.lognormal(mu, sigma, count))
        # the rule's bound caps the draws a long tail takes past it (an int64 cast of inf
        # would wrap); below it the draws are as they were
        return np.clip(values, low, rule.high if high is None else high).astype(np.int64)
    return _empirical(dist, count, rng, where, base_dir)


def _empirical(dist: dict, count: int, rng: np.random.Generator, where: str,
               base_dir: Path) -> np.ndarray:
    """Resample a column of a trace file with replacement."""
    trace = _get(dist, "trace", where)
    if not isinstance(trace, (str, Path)):
        raise InputError(f"{where}.trace must be a path to a trace file, got {trace!r}")
    path = base_dir / trace
    if not path.is_file():
        raise InputError(f"{where}.trace: file not found: {path}")
    valid = ["prompt_tokens", "output_tokens", "n"]
    default = where.rsplit(".", 1)[-1]
    column = dist.get("column", default if default in valid else None)
    if column not in valid:
        raise InputError(f"{where}.column must be one of {', '.join(valid)}, got {column!r}")
    fmt = dist.get("format", "auto")
    if fmt not in ("auto",) + FORMATS:
        raise InputError(f"{where}.format must be one of auto, {', '.join(FORMATS)}, got {fmt!r}")
    values = load_trace(path, format=fmt)[column].to_numpy()
    rule = _length_rule(where)
    if values.size and (values.min() < rule.low or values.max() > rule.high):
        raise InputError(f"{where}.trace: {path}: column {column} has values outside "
                         f"{rule.interval()}; expected {rule.describe()}")
    return rng.choice(values, count, replace=True).astype(np.int64)


def _shared_prefix(shared: dict, prompt: np.ndarray, rng: np.random.Generator) -> dict:
    """Prepend group system prompts to a fraction of requests; return their prefix id columns.

    Block j of a request covers tokens [B*j, B*(j+1)). Blocks that lie wholly inside the group's
    system prompt get id `group * S + j` (S = full prefix blocks per group); every other block
    gets a fresh id from G*S upward, unique in the whole frame. So equal ids at position j imply
    equal prefixes up to j (chained), and shared and unique ids never collide.
    """
    where = f"{WHERE}.shared_prefix"
    if not isinstance(shared, dict):
        raise InputError(f"{where} must be a mapping with keys {', '.join(SHARED_PREFIX_KEYS)}")
    _check_keys(shared, SHARED_PREFIX_KEYS, where)
    groups = _integer(shared, "num_groups", where)
    prefix_tokens = _integer(shared, "prefix_tokens", where)
    fraction = _number(shared, "fraction", where)
    block = _integer(shared, "block_tokens", where, default=16)

    count = len(prompt)
    chosen = np.sort(_choose(rng, count, fraction))
    group = rng.integers(0, groups, len(chosen))
    prompt = prompt.copy()
    prompt[chosen] += prefix_tokens
    shared_blocks = prefix_tokens // block
    unique_blocks = -(-prompt[chosen] // block) - shared_blocks
    ids = int(unique_blocks.sum()) + len(chosen) * shared_blocks
    if ids > MAX_PREFIX_IDS:
        raise InputError(f"{where}: the shared prompts make {ids:,} prefix block ids, more "
                         f"than the simulator keeps ({MAX_PREFIX_IDS:,}); raise "
                         f"{where}.block_tokens or shorten the prompts")
    unique_start = groups * shared_blocks + np.concatenate([[0], np.cumsum(unique_blocks)[:-1]])
    prefix_ids = [None] * count
    for i, g, start, k in zip(chosen.tolist(), group.tolist(), unique_start.tolist(),
                              unique_blocks.tolist()):
        first = g * shared_blocks
        prefix_ids[i] = tuple(range(first, first + shared_blocks)) + tuple(range(start, start + k))
    block_tokens = np.zeros(count, dtype=np.int64)
    block_tokens[chosen] = block
    return {"prompt_tokens": prompt, "prefix_ids": prefix_ids, "prefix_block_tokens": block_tokens}


def _turns(conversation: dict, starts: int, rng: np.random.Generator, base_dir: Path) -> tuple:
    """Turns per conversation, then the new tokens and the think time (s) of each turn after
    the first, in conversation order."""
    where = f"{WHERE}.conversation"
    if not isinstance(conversation, dict):
        raise InputError(f"{where} must be a mapping with keys {', '.join(CONVERSATION_KEYS)}, "
                         f"like {{turns: 4, think_time_s: 30, new_tokens: 150}}")
    _check_keys(conversation, CONVERSATION_KEYS, where)
    turn_rng, new_rng, think_rng = rng.spawn(3)
    turns = _lengths(_get(conversation, "turns", where), starts, turn_rng, f"{where}.turns",
                     base_dir)
    later = int(turns.sum()) - starts
    new_tokens = _lengths(_get(conversation, "new_tokens", where), later, new_rng,
                          f"{where}.new_tokens", base_dir)
    think_s = _seconds(_get(conversation, "think_time_s", where), later, think_rng,
                       f"{where}.think_time_s")
    return turns, new_tokens, think_s


def _seconds(dist, count: int, rng: np.random.Generator, where: str) -> np.ndarray:
    """Draw `count` durations >= 0 s from a number (fixed) or a duration distribution spec."""
    if not isinstance(dist, dict):
        if isinstance(dist, bool) or not isinstance(dist, (int, float, np.number)):
            raise InputError(f"{where}: expected a number of seconds or a mapping like "
                             f"{{dist: exponential, mean: 30}}, got {dist!r}")
        return np.full(count, check_number(dist, RULES["trace.seconds"], where))
    kind = dist.get("dist")
    if kind not in SECONDS_KEYS:
        raise InputError(f"{where}.dist must be one of {', '.join(SECONDS_KEYS)}, got {kind!r}")
    _check_keys(dist, ["dist"] + SECONDS_KEYS[kind], where)
    seconds, positive = RULES["trace.seconds"], RULES["workload.synthetic.duration_s"]
    if kind == "fixed":
        return np.full(count, _number(dist, "value", where, rule=seconds))
    if kind == "uniform":
        low = _number(dist, "min", where, rule=seconds)
        high = _number(dist, "max", where, rule=seconds)
        if high < low:
            raise InputError(f"{where}.max must be >= {where}.min ({low:g}), got {high:g}")
        return rng.uniform(low, high, count)
    mean = _number(dist, "mean", where, rule=positive)
    if kind == "exponential":
        return rng.exponential(mean, count)
    sigma = _number(dist, "sigma", where, rule=RULES["lognormal.sigma"])
    return rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, count)


def _conversations(first: dict, turns: np.ndarray, new_tokens: np.ndarray,
                   think_s: np.ndarray) -> dict:
    """Per-request columns from the first turns' columns (`first`: arrival_s, prompt_tokens,
    maybe prefix_ids, prefix_block_tokens and tenant, one per conversation; output_tokens one
    per request, in conversation order): each later turn continues the one before, its prompt
    the previous prompt + output + its new tokens, arriving its think time after the previous
    turn. Rows in arrival order (stable: a turn arriving with its parent comes after it), with
    `parent_request_id` the parent's row."""
    count = int(turns.sum())
    conv = np.repeat(np.arange(len(turns)), turns)
    firsts = np.concatenate([[0], np.cumsum(turns)[:-1]]).astype(np.int64)
    later = np.ones(count, dtype=bool)
    later[firsts] = False
    output = first["output_tokens"]

    def within(values):               # running sums restarted at each conversation's first turn
        total = np.cumsum(values)
        return total - np.repeat(total[firsts], turns)

    delay = np.zeros(count)
    delay[later] = think_s
    growth = np.zeros(count, dtype=np.int64)
    growth[later] = output[:-1][later[1:]] + new_tokens
    rows = {"arrival_s": first["arrival_s"][conv] + within(delay),
            "prompt_tokens": first["prompt_tokens"][conv] + within(growth),
            "output_tokens": output,
            "parent_request_id": np.where(later, np.arange(count) - 1, -1)}
    if "prefix_ids" in first:
        ids = first["prefix_ids"]
        rows["prefix_ids"] = [None if k else ids[c]
                              for c, k in zip(conv.tolist(), later.tolist())]
        rows["prefix_block_tokens"] = np.where(later, 0, first["prefix_block_tokens"][conv])
    if "tenant" in first:
        rows["tenant"] = first["tenant"][conv]
    order = np.argsort(rows["arrival_s"], kind="stable")
    position = np.empty(count, dtype=np.int64)
    position[order] = np.arange(count)
    parent = rows["parent_request_id"]
    rows["parent_request_id"] = np.where(parent >= 0, position[np.maximum(parent, 0)], -1)
    return {name: [values[i] for i in order] if isinstance(values, list) else values[order]
            for name, values in rows.items()}


# --- validation helpers ----------------------------------------------------------------------

def _choose(rng: np.random.Generator, count: int, fraction: float) -> np.ndarray:
    """Pick round(fraction * count) distinct request indices."""
    return rng.choice(count, size=int(round(fraction * count)), replace=False)


def _check_keys(mapping: dict, valid: list[str], where: str) -> None:
    unknown = [k for k in mapping if k not in valid]
    if unknown:
        raise InputError(f"{where}.{unknown[0]}: unknown key; valid keys: {', '.join(valid)}")


def _get(mapping: dict, key: str, where: str):
    if mapping.get(key) is None:
        raise InputError(f"{where}.{key} is required")
    return mapping[key]


def _rule(where: str, key: str, fallback: Rule) -> Rule:
    """The rule of `workload.synthetic...key` in simkv.limits, or `fallback`."""
    return RULES.get(f"{where}.{key}", fallback)


def _length_rule(where: str) -> Rule:
    """The rule of a length distribution's values: samples (`n`), turns, else tokens."""
    leaf = where.rsplit(".", 1)[-1]
    return RULES[leaf] if leaf in ("n", "turns") else RULES["lengths"]


def _integer(mapping: dict, key: str, where: str, default=_MISSING, rule: Rule | None = None):
    """An integer within its rule (simkv.limits; by default the rule of where.key, else
    tokens)."""
    rule = rule or _rule(where, key, RULES["lengths"])
    value = mapping.get(key)
    if value is None:
        if default is _MISSING:
            raise InputError(f"{where}.{key} is required ({rule.describe()})")
        return default
    return check_number(value, rule, f"{where}.{key}")


def _number(mapping: dict, key: str, where: str, positive: bool = False,
            default=_MISSING, rule: Rule | None = None) -> float:
    """A number within its rule (simkv.limits; by default the rule of where.key, else a
    number of seconds, > 0 when `positive`)."""
    rule = rule or _rule(where, key, RULES["workload.synthetic.duration_s"] if positive
                         else RULES["trace.seconds"])
    value = mapping.get(key)
    if value is None:
        if default is _MISSING:
            raise InputError(f"{where}.{key} is required ({rule.describe()})")
        return default
    return check_number(value, rule, f"{where}.{key}")
