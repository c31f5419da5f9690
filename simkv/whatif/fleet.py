"""`simkv fleet`: the smallest fleet of a scenario's `cluster:` pools that meets its SLOs at a
request rate.

The rate is `simkv capacity`'s: the scenario's requests with every inter-arrival time scaled
(`workload.time_scale`), the rate being requests / span of arrivals. The SLOs are judged as
`capacity` judges them (simkv.whatif.capacity.judge_slo).

- One mixed pool: its replica count. Counts double from 1 until one passes, then bisect
  between the last failing and the first passing count: the answer passes and one replica
  fewer fails (the evidence, with its failures).
- A prefill and a decode pool (P/D): the fewest GPUs (prefill + decode replicas, up to
  `gpu_budget`) for which some prefill:decode split passes, and the best split at that count
  (the most goodput, then the lowest TTFT p90); the evidence is the best split one GPU fewer.
  GPU totals double and bisect as above; at each total every split is tried.

Cost: replicas x tensor parallel GPUs x the GPU's price per hour (profiles/gpus.yaml, with
its source and date, or `--gpu-price GPU=USD`), and per million output tokens at the fleet's
output throughput. The fleets of one round run in parallel on the dask backend when asked.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from simkv.config.scenario import load_scenario, with_overrides
from simkv.errors import InputError
from simkv.limits import RULES

MAX_REPLICAS = 512


def evaluate(raw: dict, base_dir: str, source: str, point: dict) -> dict:
    """Simulate one fleet (the scenario dict `raw` with `point`'s overrides) and judge its
    SLOs: {"point", "met", "reason", "summary"} (the summary without the per-replica lists)."""
    from simkv.sim.engine import simulate
    from simkv.whatif.capacity import judge_slo

    scenario = load_scenario(raw, point, base_dir=Path(base_dir), source=source)
    result = simulate(scenario)
    verdict = judge_slo(result.summary, result.requests, scenario.slo)
    summary = {k: v for k, v in result.summary.items() if k not in ("replicas", "pools")}
    return {"point": point, "met": verdict.met, "reason": verdict.describe(),
            "summary": summary}


class Evaluator:
    """Runs fleets (override dicts) in this process or on a dask cluster; memoised."""

    def __init__(self, scenario, backend: str, dask_address: Optional[str]):
        self.args = (scenario.raw, str(scenario.base_dir), str(scenario.path or scenario.name))
        self.backend = backend
        self.address = dask_address
        self.client = self.cluster = None
        self.seen: dict = {}
        self.runs = 0

    def __enter__(self):
        if self.backend == "dask":
            import logging
            import os
            try:
                from dask.distributed import Client, LocalCluster
            except ImportError:
                raise InputError("--backend dask needs dask.distributed: pip install "
                                 "'dask[distributed]'") from None
            if self.address:
                try:
                    self.client = Client(self.address, timeout="10s")
                except (OSError, TimeoutError) as e:
                    raise InputError(f"--dask-address {self.address}: cannot connect ({e})") \
                        from None
            else:
                self.cluster = LocalCluster(n_workers=os.cpu_count() or 1, threads_per_worker=1,
                                            processes=True, dashboard_address=None,
                                            silence_logs=logging.ERROR)
                self.client = __import__("dask.distributed").distributed.Client(self.cluster)
        return self

    def __exit__(self, *exc):
        if self.client is not None:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()
        return False

    def run(self, points: list) -> list:
        key = lambda p: tuple(sorted(p.items()))      # noqa: E731
        todo = [p for p in points if key(p) not in self.seen]
        if todo:
            if self.client is not None:
                futures = [self.client.submit(evaluate, *self.args, p, pure=False)
                           for p in todo]
                outcomes = self.client.gather(futures)
            else:
                outcomes = [evaluate(*self.args, p) for p in todo]
            for p, outcome in zip(todo, outcomes):
                self.seen[key(p)] = outcome
            self.runs += len(todo)
        return [self.seen[key(p)] for p in points]


def rate_scale(scenario, rate_rps: float) -> float:
    """The workload.time_scale that gives `rate_rps` (simkv capacity's rate)."""
    from simkv.workload.frames import load_requests_frame

    frame = load_requests_frame(with_overrides(scenario, {"workload.time_scale": 1.0}))
    span = float(frame["arrival_s"].iloc[-1]) if len(frame) else 0.0
    if span <= 0:
        raise InputError(f"{scenario.path or scenario.name}: the workload's arrivals span 0 s, "
                         "so its rate cannot be set")
    return (len(frame) / span) / rate_rps


def _prices(scenario, overrides: dict) -> dict:
    """GPU name -> USD per hour for the cluster's GPUs (InputError naming a missing one)."""
    prices = {}
    for pool in scenario.cluster.pools:
        gpu = pool.scenario.gpu
        price = overrides.get(gpu.name, gpu.price_usd_per_hour)
        if price is None:
            raise InputError(f"gpu {gpu.name}: no price in profiles/gpus.yaml; give one with "
                             f"--gpu-price {gpu.name}=USD_PER_HOUR")
        prices[gpu.name] = float(price)
    return prices


def parse_gpu_prices(items: list) -> dict:
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not sep or not name.strip() or not value > 0 or RULES["--gpu-price"].problem(value):
            raise InputError(f"--gpu-price {item!r}: expected GPU=USD_PER_HOUR, a price in (0, "
                             f"{RULES['--gpu-price'].high:,.0f}] (e.g. h200=3.5)")
        out[name.strip().lower()] = value
    return out


def smallest_passing(counts_from: int, limit: int, passes) -> tuple:
    """(smallest count in counts_from..limit with passes(count), the outcome at it, the
    outcome one below or None): doubling, then bisection, assuming more never fails."""
    low, low_out = None, None           # largest count known to fail
    count = counts_from
    while True:
        ok, out = passes(count)
        if ok:
            high, high_out = count, out
            break
        low, low_out = count, out
        if count >= limit:
            return None, None, low_out
        count = min(limit, count * 2)
    while low is not None and high - low > 1:
        mid = (low + high) // 2
        ok, out = passes(mid)
        if ok:
            high, high_out = mid, out
        else:
            low, low_out = mid, out
    return high, high_out, low_out


def find_fleet(scenario, rate_rps: float, *, gpu_prices: Optional[dict] = None,
               gpu_budget: int = 32, backend: str = "local",
               dask_address: Optional[str] = None) -> dict:
    """The smallest fleet meeting the scenario's SLOs at `rate_rps` (module doc), as the
    `--json` of `simkv fleet`."""
    where = scenario.path or scenario.name
    if scenario.cluster is None:
        raise InputError(f"{where}: simkv fleet needs a cluster: section (the pools to size)")
    if not scenario.slo:
        raise InputError(f"{where}: the scenario sets no SLOs; add an slo section")
    if not rate_rps > 0:
        raise InputError(f"--rate: must be > 0, got {rate_rps}")
    pools = scenario.cluster.pools
    roles = [p.role for p in pools]
    if roles != ["mixed"] and sorted(roles) != ["decode", "prefill"]:
        raise InputError(f"{where}: simkv fleet sizes one mixed pool, or one prefill and one "
                         f"decode pool; the cluster has {', '.join(roles)}")
    prices = _prices(scenario, gpu_prices or {})
    base = {"workload.time_scale": rate_scale(scenario, rate_rps)}
    with Evaluator(scenario, backend, dask_address) as ev:
        if roles == ["mixed"]:
            def passes(n):
                (out,) = ev.run([{**base, "cluster.pools.0.replicas": n}])
                return out["met"], out
            count, best, below = smallest_passing(1, MAX_REPLICAS, passes)
            split = None
        else:
            p_i, d_i = roles.index("prefill"), roles.index("decode")

            def passes(total):
                points = [{**base, f"cluster.pools.{p_i}.replicas": p,
                           f"cluster.pools.{d_i}.replicas": total - p} for p in range(1, total)]
                outs = ev.run(points)
                met = [o for o in outs if o["met"]]
                pick = max(met or outs, key=_rank)
                return bool(met), pick
            count, best, below = smallest_passing(2, gpu_budget, passes)
            split = True
        runs = ev.runs
    if count is None:
        what = "replicas" if split is None else f"GPUs (--gpu-budget {gpu_budget})"
        limit = MAX_REPLICAS if split is None else gpu_budget
        raise InputError(f"{where}: no fleet of up to {limit} {what} meets the SLOs at "
                         f"{rate_rps:g} requests/s ({below['reason'] if below else ''})")
    counts = {p.name: best["point"].get(f"cluster.pools.{i}.replicas", p.replicas)
              for i, p in enumerate(pools)}
    tp = {p.name: int(getattr(p.scenario, "tensor_parallel_size", 1) or 1) for p in pools}
    gpus = sum(counts[p.name] * tp[p.name] for p in pools)
    cost = sum(counts[p.name] * tp[p.name] * prices[p.scenario.gpu.name] for p in pools)
    tokens_per_s = best["summary"].get("throughput_output_tokens_per_s") or 0.0
    per_million = cost / (tokens_per_s * 3600) * 1e6 if tokens_per_s > 0 else None
    largest = None
    if below is not None:
        largest = {"replicas": sum(below["point"].get(f"cluster.pools.{i}.replicas", p.replicas)
                                   for i, p in enumerate(pools)),
                   "pools": {p.name: below["point"].get(f"cluster.pools.{i}.replicas",
                                                        p.replicas)
                             for i, p in enumerate(pools)},
                   "reason": below["reason"]}
    s = best["summary"]
    return {"rate_rps": rate_rps, "rate_scale": base["workload.time_scale"],
            "slo": dict(scenario.slo), "replicas": int(sum(counts.values())), "pools": counts,
            "gpus": int(gpus), "gpu_price_usd_per_hour": prices,
            "cost_per_hour_usd": cost, "cost_per_million_output_tokens_usd": per_million,
            "largest_failing": largest, "simulations": runs,
            "at_answer": {"ttft_p90_s": s["ttft_s"]["p90"], "tpot_p90_s": s["tpot_s"]["p90"],
                          "goodput_requests_per_s": s.get("goodput_requests_per_s"),
                          "throughput_output_tokens_per_s": tokens_per_s,
                          "router": s.get("router")}}


def _rank(outcome: dict) -> tuple:
    s = outcome["summary"]
    ttft = (s.get("ttft_s") or {}).get("p90")
    return (s.get("goodput_requests_per_s") or 0.0, -(ttft if ttft is not None else math.inf))
