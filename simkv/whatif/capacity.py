"""Capacity search: the highest arrival rate at which a scenario still meets its SLOs.

Load is changed the way `workload.time_scale` changes it: every inter-arrival time of the
scenario's requests is multiplied by a scale, so the rate is `requests / duration / scale` with
`duration` the span of arrivals at scale 1. The search brackets (doubling or halving the rate from
the scenario's own) and then bisects until the bracket is narrower than `tolerance` (relative).
The answer is verified: the SLOs hold at the returned rate and fail at 1.1 × that rate (if the
latter passes, the search continues above it).

When a scenario "meets its SLOs" (`judge_slo`, also used by the capacity notebook):
- Per-request SLOs (`ttft_s`, `tpot_s`, `e2e_s`): at least `attainment` (default 90%) of the
  requests that were not cancelled by their client complete and meet every one of them at once
  (a request with one output token has no TPOT and passes that bound). Rejected requests count
  as misses. With one such SLO this is the same as its p90 being within the bound.
- `itl_s` and `queue_s` are not per-request columns: their plain keys bound the p90 of the
  summary's family (the same 90% level).
- Percentile and mean SLOs (`ttft_p99_s`, `tpot_mean_s`, ...) bound that figure of the summary.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pandas as pd

from simkv.config.scenario import with_overrides
from simkv.engine.metrics import slo_met, slo_percentile_failures
from simkv.errors import InputError
from simkv.workload.frames import block_bootstrap  # noqa: F401 (also imported from here)

SLO_ATTAINMENT = 0.9           # fraction of requests that must meet every per-request SLO
PER_REQUEST_SLOS = ("ttft_s", "tpot_s", "e2e_s")
P90_SLOS = ("itl_s", "queue_s")   # plain keys without a per-request column: bound the p90
ABOVE_FACTOR = 1.1             # the SLOs must fail this much above the returned rate
MAX_DOUBLINGS = 14
MAX_HALVINGS = 10
# The rate to plan with over K workloads (replicates): the one 90% of them sustain. The mean's
# confidence interval says where the average workload's capacity lies, not what a given day's
# traffic will bear; planning needs a low quantile of the workloads themselves.
PLANNING_QUANTILE = 0.1


# ----------------------------------------------------------------------------------------------
# Does a result meet the SLOs?


@dataclass
class SloVerdict:
    met: bool
    attainment: Optional[float]   # fraction meeting every per-request SLO; None without one
    failures: list = field(default_factory=list)   # (what, bound, value)

    def describe(self) -> str:
        if self.met:
            return "all SLOs met"
        return "; ".join(f"{what} = {_num(value)} (bound {_num(bound)})"
                         for what, bound, value in self.failures)


def judge_slo(summary: dict, requests: pd.DataFrame, slo: dict,
              attainment: float = SLO_ATTAINMENT) -> SloVerdict:
    """Judge a run (its summary and requests frame) against `slo`, by the rule of this module."""
    failures = []
    per_request = {k: v for k, v in slo.items() if k in PER_REQUEST_SLOS}
    fraction = None
    if per_request:
        served = requests[requests["status"] != "cancelled"]
        completed = served[served["status"] == "completed"]
        met = int(slo_met(completed, per_request).sum())
        fraction = met / len(served) if len(served) else None
        if fraction is None or fraction < attainment:
            bounds = ", ".join(f"{k} <= {_num(v)}" for k, v in per_request.items())
            failures.append((f"fraction of requests meeting {bounds}", attainment, fraction))
    for key in P90_SLOS:
        if key in slo:
            value = (summary.get(key) or {}).get("p90")
            if value is None or value > slo[key]:
                failures.append((f"{key}.p90", slo[key], value))
    for key, bound, value in slo_percentile_failures(summary, slo):
        failures.append((key, bound, value))
    return SloVerdict(not failures, fraction, failures)


def _num(value) -> str:
    return "none" if value is None else f"{value:.4g}"


# ----------------------------------------------------------------------------------------------
# The search


@dataclass
class Probe:
    rate_rps: float
    rate_scale: float             # the workload.time_scale giving that rate
    verdict: SloVerdict
    summary: dict


@dataclass
class CapacityResult:
    max_rate_rps: float
    rate_scale: float
    slo: dict
    attainment: float
    tolerance: float
    summary: dict                 # at max_rate_rps
    at_rate: Probe
    above: Probe                  # at ABOVE_FACTOR × max_rate_rps: fails
    probes: list                  # every probe, in the order run: (rate_rps, met)
    ci: Optional[dict] = None

    @property
    def planning_rate_rps(self) -> float:
        """The rate to plan with: with replicates, the PLANNING_QUANTILE of the workloads'
        rates (planning_rate); with one workload, its own rate (no spread known)."""
        if self.ci is None:
            return self.max_rate_rps
        return planning_rate(self.ci["replicates"])

    def planning(self) -> dict:
        """{rate_rps, quantile, workloads, basis}: which rate to plan with and why."""
        workloads = len(self.ci["replicates"]) if self.ci is not None else 1
        if self.ci is None:
            basis = ("one workload: its own rate (run with --replicates K to see how much "
                     "another window of the same traffic moves it)")
        else:
            basis = (f"the {PLANNING_QUANTILE:.0%} quantile of the {workloads} workloads' "
                     "rates: 90% of them meet the SLOs at it")
        return {"rate_rps": self.planning_rate_rps,
                "quantile": PLANNING_QUANTILE if self.ci is not None else None,
                "workloads": workloads, "basis": basis}

    def to_json(self) -> dict:
        out = {
            "max_rate_rps": self.max_rate_rps,
            "planning_rate_rps": self.planning_rate_rps,
            "planning": self.planning(),
            "rate_scale": self.rate_scale,
            "slo": dict(self.slo),
            "slo_attainment": self.attainment,
            "tolerance": self.tolerance,
            "verified": {
                "at_rate": {"rate_rps": self.at_rate.rate_rps, "met": self.at_rate.verdict.met,
                            "attainment": self.at_rate.verdict.attainment},
                "above": {"rate_rps": self.above.rate_rps, "rate_scale": self.above.rate_scale,
                          "met": self.above.verdict.met,
                          "attainment": self.above.verdict.attainment,
                          "failures": [list(f) for f in self.above.verdict.failures]},
            },
            "probes": [{"rate_rps": r, "met": m} for r, m in self.probes],
            "summary": self.summary,
        }
        if self.ci is not None:
            out["ci"] = self.ci
        return out


class CapacitySearch:
    """Probes one scenario's request frame at different rates (scaled arrivals)."""

    def __init__(self, scenario, frame: pd.DataFrame, attainment: float = SLO_ATTAINMENT,
                 overrides: Optional[dict] = None, on_probe=None):
        """`frame`: the requests at workload.time_scale 1 (arrivals from 0 s); `overrides`:
        dotted keys that made `frame` (a replicate's seed), applied to every probe."""
        self.scenario = scenario
        self.frame = frame
        self.overrides = dict(overrides or {})
        self.attainment = attainment
        span_s = float(frame["arrival_s"].iloc[-1]) if len(frame) else 0.0
        if span_s <= 0:
            raise InputError(f"{scenario.path or scenario.name}: the workload's arrivals span 0 s,"
                             " so its rate cannot be scaled (it needs at least two arrival times)")
        self.base_rate_rps = len(frame) / span_s
        self.probes: dict[float, Probe] = {}
        self.order: list = []
        self.on_probe = on_probe      # called with each new Probe (progress)

    def scale_for(self, rate_rps: float) -> float:
        return self.base_rate_rps / rate_rps

    def probe(self, rate_rps: float) -> Probe:
        """Simulate at `rate_rps` (memoised) and judge the SLOs."""
        from simkv.sim.engine import simulate

        if rate_rps in self.probes:
            return self.probes[rate_rps]
        scale = self.scale_for(rate_rps)
        # Always from the scenario as loaded from its file: a Scenario made by with_overrides
        # has no path, so its relative paths would resolve against the current folder.
        scenario = with_overrides(self.scenario, {**self.overrides, "workload.time_scale": scale})
        frame = self.frame.assign(arrival_s=self.frame["arrival_s"] * scale)
        result = simulate(scenario, trace_df=frame)
        verdict = judge_slo(result.summary, result.requests, scenario.slo, self.attainment)
        probe = Probe(rate_rps, scale, verdict, result.summary)
        self.probes[rate_rps] = probe
        self.order.append((rate_rps, verdict.met))
        if self.on_probe is not None:
            self.on_probe(probe)
        return probe

    def search(self, start_rate_rps: float, tolerance: float) -> tuple[Probe, Probe]:
        """(highest passing probe, failing probe at ABOVE_FACTOR × its rate)."""
        low, high = self._bracket(start_rate_rps)
        while True:
            while high.rate_rps / low.rate_rps - 1 > tolerance:
                mid = self.probe((low.rate_rps + high.rate_rps) / 2)
                low, high = (mid, high) if mid.verdict.met else (low, mid)
            above = self.probe(low.rate_rps * ABOVE_FACTOR)
            if not above.verdict.met:
                return low, above
            # Not monotone here (noise): the answer lies higher; bracket again from there.
            low, high = self._bracket(above.rate_rps)

    def _bracket(self, rate_rps: float) -> tuple[Probe, Probe]:
        first = self.probe(rate_rps)
        if first.verdict.met:
            low = first
            for _ in range(MAX_DOUBLINGS):
                high = self.probe(low.rate_rps * 2)
                if not high.verdict.met:
                    return low, high
                low = high
            raise InputError(f"{self._name()}: the SLOs still hold at {low.rate_rps:.4g} "
                             "requests/s; they do not bound the rate (tighten them)")
        high = first
        for _ in range(MAX_HALVINGS):
            low = self.probe(high.rate_rps / 2)
            if low.verdict.met:
                return low, high
            high = low
        raise InputError(f"{self._name()}: the SLOs fail even at {high.rate_rps:.4g} requests/s "
                         f"({high.verdict.describe()}); loosen them or change the scenario")

    def _name(self) -> str:
        return str(self.scenario.path or self.scenario.name)


# ----------------------------------------------------------------------------------------------
# Replicates: the same search on resampled workloads, for a confidence interval


RESAMPLE = ("bootstrap", "windows")


def replicate_frame(scenario, replicate: int, resample: str = "bootstrap"
                    ) -> tuple[dict, pd.DataFrame]:
    """(overrides, requests at time_scale 1) for replicate k: k = 0 is the scenario as given.
    A synthetic workload (or a trace with `workload.resample: bootstrap`) draws again with
    seed + k. A plain trace is block-bootstrapped (`resample` bootstrap, seeded by (seed, k)) or
    shifted by k windows (`windows`: offset + k × limit, the next stretch of the same trace)."""
    from simkv.workload.frames import load_requests_frame

    wl = scenario.workload
    reseeded = wl.trace is None or getattr(wl, "resample", None) == "bootstrap"
    overrides = {}
    if replicate and reseeded:
        overrides = {"seed": scenario.seed + replicate}
    elif replicate and resample == "windows":
        if wl.limit is None:
            raise InputError(f"{scenario.path or scenario.name}: --resample windows needs "
                             "workload.limit (the window's length in requests)")
        overrides = {"workload.offset": wl.offset + replicate * wl.limit}
    frame = load_requests_frame(with_overrides(scenario,
                                               {**overrides, "workload.time_scale": 1.0}))
    if replicate and not reseeded and resample == "windows" and len(frame) < wl.limit:
        raise InputError(f"{wl.trace}: window {replicate + 1} (requests from "
                         f"{overrides['workload.offset']}) holds only {len(frame)} of "
                         f"{wl.limit} requests: the trace has room for fewer replicates")
    if replicate and not reseeded and resample == "bootstrap":
        frame = block_bootstrap(frame, np.random.default_rng([scenario.seed, replicate]))
    return overrides, frame


def _search_replicate(scenario, replicate: int, start_scale: float, tolerance: float,
                      attainment: float, resample: str = "bootstrap",
                      on_probe=None) -> tuple[Probe, Probe, list]:
    overrides, frame = replicate_frame(scenario, replicate, resample)
    search = CapacitySearch(scenario, frame, attainment, overrides, on_probe)
    low, above = search.search(search.base_rate_rps / start_scale, tolerance)
    return low, above, search.order


def planning_rate(rates: list[float], quantile: float = PLANNING_QUANTILE) -> float:
    """The rate to plan with across workloads: the `quantile` of their rates (linear between
    order statistics), so that 1 − quantile of them meet the SLOs at it."""
    return float(np.quantile(np.asarray(rates, dtype=float), quantile))


def confidence_interval(rates: list[float]) -> dict:
    """95% Student t interval for the mean of `rates`, and their spread (`min`, `max`: the
    interval every workload's own rate lies in, the scenario's among them)."""
    from scipy import stats

    values = np.asarray(rates, dtype=float)
    k = len(values)
    mean = float(values.mean())
    std = float(values.std(ddof=1)) if k > 1 else 0.0
    half = float(stats.t.ppf(0.975, k - 1)) * std / math.sqrt(k) if k > 1 else 0.0
    return {"level": 0.95, "low": mean - half, "high": mean + half, "mean": mean, "std": std,
            "min": float(values.min()), "max": float(values.max()),
            "replicates": [float(r) for r in rates]}


def find_capacity(scenario, *, tolerance: float = 0.02, replicates: int = 1,
                  attainment: float = SLO_ATTAINMENT, workers: Optional[int] = None,
                  on_progress=None, resample: str = "bootstrap") -> CapacityResult:
    """The highest arrival rate (requests/s) at which `scenario` meets its SLOs.

    `tolerance`: relative width of the final bracket. With `replicates` K > 1, K searches (the
    scenario, then K − 1 reseeded, resampled or shifted workloads: replicate_frame) run in
    parallel; `ci` gives their rates, their spread (min, max) and a 95% t interval of their
    mean (`resample`: how a trace's replicates are made, replicate_frame);
    `max_rate_rps` is always the scenario's own and `planning_rate_rps` the rate to plan
    with (the PLANNING_QUANTILE of the workloads' rates). `on_progress(text)` is called after
    each simulation (one workload) or each finished workload (replicates).
    """
    if not scenario.slo:
        raise InputError(f"{scenario.path or scenario.name}: the scenario sets no SLOs; add an "
                         "slo section or --set slo.ttft_s=1.0 (valid keys: ttft_s, tpot_s, "
                         "e2e_s, itl_s, queue_s, and percentile forms like ttft_p90_s)")
    if not 0 < tolerance < round(ABOVE_FACTOR - 1, 9):   # finer than the +10% verification
        raise InputError(f"--tolerance: must be in (0, {ABOVE_FACTOR - 1:.2f}), got {tolerance}")
    if replicates < 1:
        raise InputError(f"--replicates: must be >= 1, got {replicates}")
    if resample not in RESAMPLE:
        raise InputError(f"--resample: {resample!r} is not one of {', '.join(RESAMPLE)}")
    args = (scenario.workload.time_scale, tolerance, attainment, resample)
    if replicates == 1:
        def on_probe(probe):
            if on_progress is not None:
                on_progress(f"simulation {len(search_order)}: {probe.rate_rps:.4g} requests/s "
                            f"{'meets' if probe.verdict.met else 'fails'} the SLOs")
        search_order = []
        outcomes = [_search_replicate(scenario, 0, *args,
                                      on_probe=lambda p: (search_order.append(p), on_probe(p)))]
    else:
        outcomes = _parallel(scenario, replicates, args, workers, on_progress)
    low, above, order = outcomes[0]
    ci = confidence_interval([o[0].rate_rps for o in outcomes]) if replicates > 1 else None
    return CapacityResult(max_rate_rps=low.rate_rps, rate_scale=low.rate_scale,
                          slo=dict(scenario.slo), attainment=attainment, tolerance=tolerance,
                          summary=low.summary, at_rate=low, above=above, probes=order, ci=ci)


def _parallel(scenario, replicates: int, args: tuple, workers: Optional[int],
              on_progress=None) -> list:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    workers = min(workers or os.cpu_count() or 1, replicates)
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
        futures = [pool.submit(_search_replicate, scenario, k, *args) for k in range(replicates)]
        for done, future in enumerate(as_completed(futures), 1):
            if on_progress is not None:
                low = future.result()[0]
                on_progress(f"workload {done} of {replicates} done: {low.rate_rps:.4g} "
                            "requests/s")
        return [f.result() for f in futures]
