"""Metrics: one recorder for the simulator and the real engine, one set of definitions.

- TTFT = end of the step that computed a request's last prompt token − arrival.
- TPOT = (e2e − TTFT) / (output_tokens − 1); ITL = gaps between consecutive tokens of a sequence.
- KV utilisation and internal fragmentation are time-weighted over steps. Internal fragmentation
  is the fraction of allocated (paged) or reserved (contiguous) token slots not holding a token.
- Percentiles are over completed requests. Goodput counts completed requests meeting every SLO.
"""
from __future__ import annotations

import math
from array import array
from collections import Counter

import numpy as np
import pandas as pd

from simkv.engine.request import RequestStatus

STEP_COLUMNS = ["step", "start_s", "duration_s", "num_prefill_tokens", "num_decode_tokens",
                "num_running", "num_waiting", "kv_blocks_used", "kv_blocks_free", "preempted"]
REQUEST_COLUMNS = ["request_id", "arrival_s", "prompt_tokens", "output_tokens", "cached_tokens",
                   "recomputed_tokens", "first_token_s", "finish_s", "ttft_s", "tpot_s", "e2e_s",
                   "preemptions", "status"]
LATENCY_KEYS = ["ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s"]
_STATUS = {RequestStatus.COMPLETED: "completed", RequestStatus.CANCELLED: "cancelled",
           RequestStatus.REJECTED: "rejected"}


class MetricsRecorder:
    """Collects per-step rows (columnar, cheap to append) and time-weighted KV signals."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cols = {name: array("d") for name in STEP_COLUMNS}
        self._append = [self.cols[name].append for name in STEP_COLUMNS]
        self.busy_s = 0.0
        self.used_block_s = 0.0         # sum of used blocks × step duration
        self.frag_s = 0.0               # sum of fragmentation fraction × step duration
        self.running_seq_s = 0.0
        self.used_peak = 0
        self.running_peak = 0
        self.waiting_peak = 0
        self._hist = [0] * 64           # sequence-steps at each table length (decode runs)
        self._table_lengths = Counter()  # the same, of observed steps
        self.num_steps = 0
        self._observed = None
        # KV cache groups (a hybrid model's manager keeps `group_used`): blocks in use per group
        # x step duration, and their peaks; None until observed, False without groups
        self._group_used = None
        self.group_block_s: list = []
        self.group_peak: list = []
        # decode runs' rows, kept per run and laid out among the single steps' rows by
        # steps_frame: where each run starts among the single rows, its length, its constant
        # columns, and its steps' start times, durations and blocks in use, run after run
        self._run_at, self._run_m, self._run_n, self._run_waiting = [], [], [], []
        self._run_starts, self._run_durations, self._run_used = array("d"), array("d"), array("d")

    def observe(self, plan, scheduler) -> None:
        """Look at the KV state as the step runs (call right after `schedule`): blocks in use,
        token slots allocated but not holding a token once this step's tokens are written,
        running sequences and their block counts."""
        kv = scheduler.kv
        seqs = [seq for req in scheduler.running for seq in req.seqs]
        lengths = [len(seq.block_table) for seq in seqs]
        self._table_lengths.update(lengths)
        running = len(seqs)
        blocks = sum(lengths)
        computed = sum([seq.num_computed_tokens for seq in seqs])
        slots = kv.allocated_slots(blocks, scheduler.running)
        slot_waste = slots - computed - plan.num_tokens
        self._observed = (plan.step, plan.kv_blocks_used, slot_waste, running)
        if self._group_used is None:
            self._group_used = getattr(kv, "group_used", False)
            if self._group_used:
                self.group_block_s = [0.0] * len(self._group_used)
                self.group_peak = [0] * len(self._group_used)
        if self._group_used:
            self._group_snapshot = list(self._group_used)

    def record_step(self, plan, start_s: float, duration_s: float, scheduler=None) -> None:
        """Record one executed step, with the state `observe` saw while it ran."""
        observed = self._observed
        if observed is None or observed[0] != plan.step:
            raise RuntimeError("MetricsRecorder.observe(plan, scheduler) must follow schedule()")
        _, used, slot_waste, running = observed
        self._observed = None
        self.num_steps += 1
        waiting = plan.num_waiting
        a = self._append
        a[0](self.num_steps)
        a[1](start_s)
        a[2](duration_s)
        a[3](plan.num_prefill_tokens)
        a[4](plan.num_decode_tokens)
        a[5](running)
        a[6](waiting)
        a[7](used)
        a[8](self.num_blocks - used)
        a[9](len(plan.preempted))
        self.busy_s += duration_s
        self.used_block_s += used * duration_s
        if used:
            self.frag_s += duration_s * slot_waste / (used * self.block_size)
        self.running_seq_s += running * duration_s
        if self._group_used:
            for g, n in enumerate(self._group_snapshot):
                self.group_block_s[g] += n * duration_s
                if n > self.group_peak[g]:
                    self.group_peak[g] = n
        if used > self.used_peak:
            self.used_peak = used
        if running > self.running_peak:
            self.running_peak = running
        if waiting > self.waiting_peak:
            self.waiting_peak = waiting

    def record_decode_run(self, plan, n: int, ends: list, durations: list, used_rows: list,
                          waste_rows: list, table_steps: dict) -> None:
        """Record the steps of a decode run after `plan` (simkv.engine.decode_run): step k ran
        from ends[k - 1] for durations[k - 1] s with used_rows[k - 1] blocks in use and
        waste_rows[k - 1] slots not holding a token; the n sequences' tables spent
        table_steps[length] sequence-steps at each length. The same rows and sums as
        observing and recording each step."""
        m = len(durations)
        self.num_steps += m
        self._run_at.append(len(self.cols["step"]))
        self._run_m.append(m)
        self._run_n.append(n)
        self._run_waiting.append(plan.num_waiting)
        self._run_starts.fromlist(ends[:m])          # fromlist: a list in one go, not item
        self._run_durations.fromlist(durations)      # by item as extend takes it
        self._run_used.fromlist(used_rows)
        # the sums as record_step adds them, step after step: the same floats
        scale = self.block_size
        busy, used_s, frag, running = self.busy_s, self.used_block_s, self.frag_s, \
            self.running_seq_s
        for d, used, waste in zip(durations, used_rows, waste_rows):
            busy += d
            used_s += used * d
            if used:
                frag += d * waste / (used * scale)
            running += n * d
        self.busy_s, self.used_block_s, self.frag_s, self.running_seq_s = \
            busy, used_s, frag, running
        peak = max(used_rows)
        if peak > self.used_peak:
            self.used_peak = peak
        if n > self.running_peak:
            self.running_peak = n
        if plan.num_waiting > self.waiting_peak:
            self.waiting_peak = plan.num_waiting
        hist = self._hist
        top = max(table_steps)
        if top >= len(hist):
            hist.extend([0] * (top + 1 - len(hist)))
        for length, count in table_steps.items():
            hist[length] += count

    @property
    def blocks_per_seq_hist(self) -> list:
        """Sequence-steps at each block-table length (index: blocks), over every step, at
        least 64 entries."""
        hist = list(self._hist)
        if self._table_lengths:
            top = max(self._table_lengths)
            if top >= len(hist):
                hist.extend([0] * (top + 1 - len(hist)))
            for length, count in self._table_lengths.items():
                hist[length] += count
        return hist

    def steps_frame(self) -> pd.DataFrame:
        """The step rows in step order: the single steps' and the decode runs' (each run's rows
        where it was recorded among the single ones)."""
        singles = {name: np.frombuffer(col, dtype=np.float64) if len(col) else np.zeros(0)
                   for name, col in self.cols.items()}
        if self._run_m:
            singles = self._with_runs(singles)
        df = pd.DataFrame(singles)
        for name in STEP_COLUMNS:
            if name not in ("start_s", "duration_s"):
                df[name] = df[name].astype(np.int64)
        return df

    def _with_runs(self, singles: dict) -> dict:
        m = np.array(self._run_m, dtype=np.int64)
        at = np.array(self._run_at, dtype=np.int64)
        num_single = len(singles["step"])
        ends = np.concatenate(([0], np.cumsum(m)))            # run rows before run r: ends[r]
        total = num_single + int(ends[-1])
        # a run recorded after `at` single rows comes right after them; a single row is moved
        # down by the rows of every run recorded before it
        run_rows = np.repeat(at, m) + np.arange(int(ends[-1]))
        single_rows = np.arange(num_single) + ends[np.searchsorted(at, np.arange(num_single),
                                                                    side="right")]
        used = np.frombuffer(self._run_used, dtype=np.float64)
        batch = np.repeat(np.array(self._run_n, dtype=np.float64), m)
        runs = {"step": run_rows + 1.0,
                "start_s": np.frombuffer(self._run_starts, dtype=np.float64),
                "duration_s": np.frombuffer(self._run_durations, dtype=np.float64),
                "num_prefill_tokens": np.zeros(len(used)),
                "num_decode_tokens": batch,
                "num_running": batch,
                "num_waiting": np.repeat(np.array(self._run_waiting, dtype=np.float64), m),
                "kv_blocks_used": used,
                "kv_blocks_free": self.num_blocks - used,
                "preempted": np.zeros(len(used))}
        out = {}
        for name, col in singles.items():
            column = np.empty(total)
            column[single_rows] = col
            column[run_rows] = runs[name]
            out[name] = column
        return out


def requests_frame(requests) -> pd.DataFrame:
    """One row per request (completed, cancelled or rejected), ordered by request id."""
    rows = []
    nan = math.nan
    for r in requests:
        completed = r.status == RequestStatus.COMPLETED
        ttft = r.first_token_s - r.arrival_s if completed else nan
        e2e = r.finish_s - r.arrival_s if completed else nan
        if r.children:                # a fanned-out request: its children's mean
            tpot = r.tpot_s if completed else nan
        else:
            tpot = (e2e - ttft) / (r.output_tokens - 1) if completed and r.output_tokens > 1 \
                else nan
        rows.append((r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.cached_tokens,
                     r.recomputed_tokens, r.first_token_s, r.finish_s, ttft, tpot, e2e,
                     r.num_preemptions, _STATUS.get(r.status, "unfinished"),
                     r.admitted_s - r.arrival_s))
    df = pd.DataFrame(rows, columns=REQUEST_COLUMNS + ["queue_s"])
    return df.sort_values("request_id", kind="stable").reset_index(drop=True)


def latency_family(values) -> dict:
    """{mean, p50, p90, p99} of the values that are not NaN (all None when there are none)."""
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if not len(values):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(values.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99)}


def _hist_family(hist: list) -> dict:
    counts = np.asarray(hist, dtype=np.float64)
    total = counts.sum()
    if not total:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    values = np.arange(len(counts))
    cdf = np.cumsum(counts) / total
    pick = [int(values[np.searchsorted(cdf, q)]) for q in (0.5, 0.9, 0.99)]
    return {"mean": float((values * counts).sum() / total), "p50": pick[0], "p90": pick[1],
            "p99": pick[2]}


def slo_met(df: pd.DataFrame, slo: dict, itl_by_request=None) -> np.ndarray:
    """Per completed request: does it meet every per-request SLO (`ttft_s`, `tpot_s`, `e2e_s`,
    `queue_s` bounds; percentile SLOs are checked on the summary instead)."""
    ok = np.ones(len(df), dtype=bool)
    for key, bound in slo.items():
        if key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
            values = df[key].to_numpy()
            ok &= ~(values > bound)      # NaN TPOT (one output token) passes
    return ok


def slo_percentile_failures(summary: dict, slo: dict) -> list:
    """Percentile/mean SLOs (`ttft_p90_s`, `tpot_mean_s`, ...) violated by a summary."""
    failures = []
    for key, bound in slo.items():
        parts = key.split("_")
        if len(parts) == 3 and parts[2] == "s" and (parts[1].startswith("p") or
                                                    parts[1] == "mean"):
            family = summary.get(f"{parts[0]}_s") or {}
            value = family.get(parts[1])
            if value is not None and value > bound:
                failures.append((key, bound, value))
    return failures


def summarize(recorder: MetricsRecorder, scheduler, requests: pd.DataFrame, *, sim_duration_s: float,
              wall_time_s: float, slo: dict, cost_model: str, block_size: int) -> dict:
    """The scalars and latency families of summary.json (INTERFACE.md)."""
    kv = scheduler.kv
    completed = requests[requests["status"] == "completed"]
    total_prompt_queried = sum(r.queried_tokens for r in scheduler.done)
    total_cached = sum(r.cached_tokens for r in scheduler.done)
    duration = sim_duration_s if sim_duration_s > 0 else math.nan
    busy = recorder.busy_s if recorder.busy_s > 0 else math.nan
    summary = {
        "requests_total": int(len(requests)),
        "requests_completed": int(len(completed)),
        "requests_cancelled": int((requests["status"] == "cancelled").sum()),
        "requests_rejected": int((requests["status"] == "rejected").sum()),
        "sim_duration_s": float(sim_duration_s),
        "wall_time_s": float(wall_time_s),
        "throughput_requests_per_s": len(completed) / duration,
        "throughput_output_tokens_per_s": float(
            (completed["output_tokens"] * _samples(scheduler, completed)).sum()) / duration,
        "ttft_s": latency_family(completed["ttft_s"]),
        "tpot_s": latency_family(completed["tpot_s"]),
        "itl_s": latency_family(np.frombuffer(scheduler.itl_s, dtype=np.float64)
                         if len(scheduler.itl_s) else []),
        "e2e_s": latency_family(completed["e2e_s"]),
        "queue_s": latency_family(completed["queue_s"]),
    }
    if slo:
        met = slo_met(completed, slo)
        summary["goodput_requests_per_s"] = float(met.sum()) / duration
    summary.update({
        "num_blocks": int(kv.num_blocks),
        "block_size": int(block_size),
        "num_steps": int(recorder.num_steps),
        "kv_utilization_mean": recorder.used_block_s / (busy * kv.num_blocks),
        "kv_utilization_peak": recorder.used_peak / kv.num_blocks,
        "internal_fragmentation_mean": recorder.frag_s / busy,
        "blocks_per_seq": _hist_family(recorder.blocks_per_seq_hist),
        "running_mean": recorder.running_seq_s / busy,
        "running_peak": int(recorder.running_peak),
        "waiting_peak": int(recorder.waiting_peak),
        "preemptions": int(scheduler.num_preemptions),
        "preemptions_per_s": scheduler.num_preemptions / duration,
        "swap_fallbacks": int(scheduler.num_swap_fallbacks),
        "prefix_cache_hit_ratio": (total_cached / total_prompt_queried
                                   if total_prompt_queried else 0.0),
        **hit_ratio_split(scheduler.done, total_cached, total_prompt_queried),
        "cached_tokens": int(total_cached),
        "recomputed_tokens": int(requests["recomputed_tokens"].sum()),
        "cow_copies": int(kv.num_cow_copies),
        "swapped_out_blocks": int(kv.swapped_out_blocks),
        "swapped_in_blocks": int(kv.swapped_in_blocks),
        "leaked_blocks": int(kv.num_used_blocks),
        "cost_model": cost_model,
    })
    if scheduler.cap_output_tokens:
        summary["requests_capped"] = int(scheduler.num_capped)   # outputs cut at max_model_len
    if recorder.group_block_s:
        # per KV cache group (a hybrid model): blocks in use, time-weighted mean and peak
        summary["kv_groups"] = [
            {"group": g, "attention_type": kind, "num_layers": layers,
             "blocks_used_mean": block_s / busy, "blocks_used_peak": int(peak)}
            for g, (kind, layers, block_s, peak) in enumerate(zip(
                kv.kinds, kv.num_layers, recorder.group_block_s, recorder.group_peak))]
    if hasattr(kv, "external_fragmentation"):
        summary["external_fragmentation_end"] = kv.external_fragmentation()
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in summary.items()}


def hit_ratio_split(done, cached: int, queried: int) -> dict:
    """`prefix_cache_hit_ratio` (cached / queried prompt tokens, every admission) in two parts
    that sum to it, over the same denominator: `prefix_cache_self_rehit_ratio`, the tokens a
    request re-admitted after a preemption hit beyond what it hit at its first admission (its
    own blocks, back again), and `prefix_cache_cross_request_hit_ratio`, the rest (reuse of
    other requests' blocks). From two per-request counters the scheduler keeps."""
    rehit = sum(r.self_rehit_tokens for r in done)
    if not queried:
        return {"prefix_cache_cross_request_hit_ratio": 0.0,
                "prefix_cache_self_rehit_ratio": 0.0}
    return {"prefix_cache_cross_request_hit_ratio": (cached - rehit) / queried,
            "prefix_cache_self_rehit_ratio": rehit / queried}


def add_input_notes(summary: dict, frame) -> dict:
    """Append to a summary what became of the input on the way in: `requests_dropped` (trace
    rows left out, e.g. 0-token rows; `requests_total` counts the kept ones) and `warnings`,
    one line with its count for each change made instead of a refusal (rows dropped, arrivals
    re-sorted, outputs capped at max_model_len). Returns the summary."""
    dropped = {str(k): int(v) for k, v in frame.attrs.get("dropped", {}).items()}
    warnings = [f"dropped {n:,} trace row(s): {reason}" for reason, n in dropped.items()]
    warnings += [str(w) for w in frame.attrs.get("warnings", [])]
    capped = summary.get("requests_capped") or 0
    if capped:
        warnings.append(f"{capped:,} request(s) asked for more output than max_model_len "
                        "leaves them; their outputs were capped")
    summary["requests_dropped"] = sum(dropped.values())
    summary["warnings"] = warnings
    return summary


def _samples(scheduler, completed: pd.DataFrame) -> np.ndarray:
    """Samples per completed request's output_tokens (n; 1 for a fanned-out request, whose
    row sums its children's), aligned with `completed`."""
    n_by_id = {r.request_id: 1 if r.children else r.n for r in scheduler.done}
    return completed["request_id"].map(n_by_id).to_numpy()
