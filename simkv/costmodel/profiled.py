"""Profiled step-cost model: `predict(plan) -> seconds` from a fit of real GPU measurements.

The fit (`profiles/<gpu>/<model>/fit.json`, written by `simkv fit`) holds per-block-size
coefficients of an auditable formula (see `simkv.fitting.fit`). A block size between two
profiled ones uses coefficients interpolated linearly in log2(block size); one outside the
profiled range is refused.
"""
from __future__ import annotations

import bisect
import math
from pathlib import Path

from simkv.costmodel.fit_file import BlockSizeNotProfiled, find_profile, read_fit
from simkv.costmodel.step_cost import TermModel, exact_partials
from simkv.costmodel.step_formula import (LOG_BATCH_KNOTS, engine_host_seconds, hats,
                                          transfer_seconds)
from simkv.errors import InputError, read_json_object
from simkv.specs import KV_DTYPE_BYTES

__all__ = ["BlockSizeNotProfiled", "ProfiledCostModel", "find_profile"]

FORWARD_TERMS = ("linear", "decode_attention", "shared_read_saving", "decode_tail",
                 "prefill_attention", "prefill_context", "prefill_tail", "per_sequence",
                 "mixed_graph_input", "prefill_rows", "window_attention", "experts",
                 "eager_launch", "host_floor")
AROUND_TERMS = ("engine_host", "serving_prep", "block_copies", "swap_out", "swap_in")
_NO_FORWARD = (0.0,) * len(FORWARD_TERMS)


def _as_laid_out(plan) -> tuple:
    """A step with prefill chunks as the executor lays it out: (prefill tokens, prefill chunks,
    decode context, prefill pairs, prefill context, longest decode context, the decode rows'
    contexts in batch order, the (start, tokens) of the chunks of two or more tokens). A
    one-token chunk is a decode row (a full prefix hit computes the prompt's last token again)."""
    prefill_tokens, prefill_seqs = plan.num_prefill_tokens, plan.num_prefill_seqs
    decode_context = plan.decode_context_tokens
    pairs, prefill_context = plan.prefill_attention_pairs, plan.prefill_context_tokens
    longest = plan.decode_max_context
    contexts, chunks, ones = [], [], []
    for s in plan.scheduled:
        if s.num_tokens > 1:
            chunks.append((s.start, s.num_tokens))
        else:
            contexts.append(s.start + 1)
            if not s.is_decode:
                ones.append(s.start + 1)
    if ones:
        k, context = len(ones), sum(ones)
        prefill_tokens, prefill_seqs = prefill_tokens - k, prefill_seqs - k
        decode_context += context
        pairs, prefill_context = pairs - context, prefill_context - context
        longest = max(longest, max(ones))
    return (prefill_tokens, prefill_seqs, decode_context, pairs, prefill_context, longest,
            contexts, chunks)


class ProfiledCostModel(TermModel):
    """Step seconds from a fitted profile, for one block size and KV dtype, as named terms:
    the fitted forward pass (FORWARD_TERMS: linear layers, decode attention less the saving of
    shared blocks read again, the decode and prefill kernels' tails, prefill attention, per
    sequence, a mixed graph's input, prefill rows; an eager step's launches, or the host's
    floor under a small eager step) and what the engine spends around it (AROUND_TERMS)."""

    is_estimate = False
    term_names = FORWARD_TERMS + AROUND_TERMS
    engine_host_on = True          # the engine_host effect (its two terms); off: both are 0

    def __init__(self, fit: dict, path: Path, block_size: int = 16, kv_dtype: str = "bf16",
                 model=None, gpu=None, scheduler=None):
        """`scheduler` (a scenario's scheduler settings, optional): the engine's graph sizes and
        table width follow its max_num_seqs, max_num_batched_tokens and max_model_len rather
        than the profile's."""
        self.path = Path(path)
        self.fit = fit
        self.block_size = int(block_size)
        self.kv_dtype = kv_dtype
        self.notes: list[str] = []
        read = read_fit(fit, self.path, model)
        self.block_sizes, self.token_knots = read.block_sizes, read.token_knots
        self.graph_batch_sizes, self.layout, self.step = (read.graph_batch_sizes, read.layout,
                                                          read.step)
        self.swap, self.copy = read.swap, read.copy
        self.engine_host, self.serving_host = read.engine_host, read.serving_host
        gpu_name = fit["gpu"]
        self.name = f"profile:{gpu_name}/{fit['model']}"
        if gpu is not None and gpu.name != gpu_name:
            raise InputError(f"{self.path}: profile is for gpu {gpu_name}, scenario gpu is "
                             f"{gpu.name} (use cost_model: roofline for other GPUs)")
        self.coefs, interpolated = read.coefs_for(self.block_size)
        if interpolated:
            self.interpolated_from = interpolated
            self.notes.append(f"block size {self.block_size} not profiled: coefficients "
                              f"interpolated in log2(block size) between {interpolated[0]} "
                              f"and {interpolated[1]}")
        # The profile measured a bf16 KV cache; with fp8 the KV-read terms move half the bytes.
        kv_bytes = KV_DTYPE_BYTES.get(kv_dtype, 2)
        measured = KV_DTYPE_BYTES.get(fit.get("kv_dtype", "bf16"), 2)
        if kv_bytes != measured:
            ratio = kv_bytes / measured
            for key in ("a_decode_s_per_token", "a_decode_longest_s_per_token",
                        "a_prefill_ctx_s_per_token", "a_window_decode_s_per_token"):
                if key not in self.coefs:
                    continue
                v = self.coefs[key]
                self.coefs[key] = [x * ratio for x in v] if isinstance(v, list) else v * ratio
            self.notes.append(f"kv_dtype {kv_dtype}: KV-read terms scaled by {ratio:g} from the "
                              f"{fit.get('kv_dtype', 'bf16')} measurement (not measured)")
        if model is not None:
            kv_per_token = model.kv_bytes_per_token(kv_dtype)
        else:
            kv_per_token = float(fit.get("kv_bytes_per_token", 0)) * kv_bytes / measured
        self.bytes_per_block = kv_per_token * self.block_size
        if scheduler is not None:
            self._follow_scheduler(scheduler, model)
        self.use_shared_reads(None)
        self._prepare()

    def use_shared_reads(self, shared_reads: dict | None) -> None:
        """A block that several decode sequences read (forks, prefix hits) is read again from
        L2: its first repeat saves `shared_reads['saving_first']` of a read from HBM, each
        further repeat `shared_reads['saving_further']` (a measurement beside the fit,
        `simkv.costmodel.shared_reads.load_shared_reads`); None: repeats cost as much as any."""
        first = further = 0.0
        if shared_reads is not None:
            first, further = shared_reads["saving_first"], shared_reads["saving_further"]
        self.shared_reads = shared_reads
        self._shared_saving_first = first
        self._shared_saving_further = further

    def _follow_scheduler(self, sched, model) -> None:
        """The step layout of an engine run with these scheduler settings (as the executor
        derives its captured sizes: simkv.gpu.graph_steps)."""
        from dataclasses import replace

        from simkv.launch_policy import decode_graph_sizes, mixed_graph_sizes
        layout = self.layout
        changes = {"max_num_seqs": sched.max_num_seqs}
        max_len = sched.max_model_len or (model.max_position_embeddings if model else 0)
        if max_len:
            changes["max_model_len"] = max_len
        if self.graph_batch_sizes:     # as with the mixed sizes: the profiled engine's list
            self.graph_batch_sizes = decode_graph_sizes(sched.max_num_seqs,
                                                        sorted(self.graph_batch_sizes))
            changes["graph_batch_sizes"] = tuple(self.graph_batch_sizes)
        if layout.mixed_token_sizes:     # the sizes the profiled engine captured, cut to budget
            changes["mixed_token_sizes"] = tuple(mixed_graph_sizes(
                sched.max_num_batched_tokens, sorted(layout.mixed_token_sizes)))
        self.layout = replace(layout, **changes)

    # -- loading ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path, block_size: int = 16, kv_dtype: str = "bf16", model=None,
             gpu=None, scheduler=None) -> "ProfiledCostModel":
        """Read a fit.json (InputError naming the file and key when it is unusable)."""
        path = Path(path)
        if path.is_dir():
            path = path / "fit.json"
        fit = read_json_object(path, "a fit file: run `simkv fit` on a profile directory")
        return cls(fit, path, block_size, kv_dtype, model, gpu, scheduler)

    def _prepare(self) -> None:
        c = self.coefs
        self._t_lin = c["t_linear_s"]
        self._a_dec = c["a_decode_s_per_token"]
        self._a_pf = c["a_prefill_s_per_pair"]
        self._a_ctx = c["a_prefill_ctx_s_per_token"]
        self._a_ptail = c["a_prefill_tail_s_per_token"]
        self._c_seq = c["c_seq_s"]
        self._c_eager = c["c_eager_s"]
        self._c_mixed_seq = c["c_mixed_seq_s"]
        self._c_mixed = c["c_mixed_s"]
        self._c_prefill_row = c["c_prefill_row_s"]
        self._a_long = c["a_decode_longest_s_per_token"]
        self._h0 = c["host_floor_s"]
        self._h_seq = c["host_floor_s_per_seq"]
        self._a_win_dec = c.get("a_window_decode_s_per_token", 0.0) if self.layout.has_window \
            else 0.0
        self._a_win_pf = c.get("a_window_prefill_s_per_pair", 0.0) if self.layout.has_window \
            else 0.0
        self._a_expert = c.get("a_expert_s", 0.0) if self.layout.has_experts else 0.0
        self._expert_cache: dict = {}      # (tokens, rows) -> the experts term
        self._max_graph = self.graph_batch_sizes[-1] if self.graph_batch_sizes else 0
        self._linear_cache: dict = {}      # rows -> T_lin(rows); the simulator asks every step
        self._a_dec_cache: dict = {}       # decode batch -> a_dec(batch)
        self._run_constants: dict = {}     # (batch, around terms) -> decode_run_split's sums
        self._graph_rows = [next((b for b in self.graph_batch_sizes if b >= n), n)
                            for n in range(self._max_graph + 1)]

    def _linear(self, rows: int) -> float:
        """T_lin(rows): linear between token knots, the last segment extended."""
        knots, values = self.token_knots, self._t_lin
        if rows <= knots[0] or len(knots) == 1:
            return values[0]
        i = min(bisect.bisect_left(knots, rows), len(knots) - 1)
        f = (rows - knots[i - 1]) / (knots[i] - knots[i - 1])
        return values[i - 1] + f * (values[i] - values[i - 1])

    # -- the model ----------------------------------------------------------------------------
    def decode_token_seconds(self, decodes: int) -> float:
        """Decode attention's seconds per context token read, in a batch of `decodes`."""
        a_dec = self._a_dec
        if len(a_dec) == 1:
            return a_dec[0]
        per_token = self._a_dec_cache.get(decodes)
        if per_token is None:
            w = hats(math.log2(decodes), LOG_BATCH_KNOTS, False)
            per_token = self._a_dec_cache[decodes] = sum(wi * ai for wi, ai in zip(w, a_dec))
        return per_token

    def forward_seconds(self, plan) -> float:
        """Seconds of the forward pass of `plan` (no copies or swaps)."""
        return math.fsum(self.forward_values(plan))

    def forward_values(self, plan) -> tuple:
        """The forward pass's terms (FORWARD_TERMS, in seconds).

        Steps are laid out as the executor lays them out (simkv.gpu.executor): every item of one
        token is a decode-kernel row, a one-token prefill chunk too (a full prefix hit computes
        the prompt's last token again), so such a chunk counts as a decode here."""
        tokens = plan.num_prefill_tokens + plan.num_decode_tokens
        if tokens == 0:
            return _NO_FORWARD
        if plan.num_prefill_tokens:
            (prefill_tokens, prefill_seqs, decode_context, pairs, prefill_context, longest,
             contexts, chunks) = _as_laid_out(plan)
        else:
            prefill_tokens = prefill_seqs = pairs = prefill_context = 0
            decode_context, longest = plan.decode_context_tokens, plan.decode_max_context
            contexts = chunks = None   # the decode tail's contexts; the prefill tail's chunks
        num_seqs = len(plan.scheduled)
        decodes = num_seqs - prefill_seqs
        layout = self.layout
        if prefill_tokens:
            mixed = tokens
            rows = layout.mixed_size(tokens)
            graph = rows > 0
            rows = rows or tokens
        else:
            mixed = 0
            graph = decodes <= self._max_graph
            rows = self._graph_rows[tokens] if graph else tokens
        linear = self._linear_cache.get(rows)
        if linear is None:
            linear = self._linear_cache[rows] = self._linear(rows)
        decode = saving = tail = 0.0
        if decodes:          # repeated reads of shared blocks save part of a read each
            per_token = self.decode_token_seconds(decodes)
            decode = per_token * decode_context
            repeats = plan.decode_shared_context_tokens
            if repeats:
                first = plan.decode_shared_block_tokens
                saving = -per_token * (self._shared_saving_first * first
                                       + self._shared_saving_further * (repeats - first))
            if self._a_long:
                if contexts is None and (layout.decode_tail_in_order or not longest):
                    contexts = [s.start + 1 for s in plan.scheduled]   # every item decodes
                if not longest:
                    longest = max(contexts)
                tail = self._a_long * layout.decode_tail_tokens(
                    decodes, longest, decode_context, graph, self.block_size, mixed,
                    contexts if layout.decode_tail_in_order else None)
        prefill_tail = self._a_ptail * layout.prefill_tail_tokens(chunks) \
            if self._a_ptail and prefill_tokens else 0.0
        mixed_input = self._c_mixed_seq * decodes + self._c_mixed if graph and mixed else 0.0
        prefill_rows = self._c_prefill_row * rows if mixed else 0.0
        window = 0.0
        if self._a_win_dec and decodes:       # the sliding layers read at most the window
            if contexts is None:
                contexts = [s.start + 1 for s in plan.scheduled]    # every item decodes
            window = self._a_win_dec * layout.window_decode_tokens(decodes, decode_context,
                                                                   contexts)
        if self._a_win_pf and prefill_tokens:
            window += self._a_win_pf * layout.window_prefill_pairs(chunks, pairs)
        values = (linear, decode, saving, tail, self._a_pf * pairs, self._a_ctx * prefill_context,
                  prefill_tail, self._c_seq * num_seqs, mixed_input, prefill_rows, window,
                  self._experts(tokens, rows))
        if graph:
            return values + (0.0, 0.0)
        # Eager: every kernel is launched from Python; small steps wait on the host.
        floor = self._h0 + self._h_seq * num_seqs - math.fsum(values) - self._c_eager
        return values + (self._c_eager, max(0.0, floor))

    def _experts(self, tokens: int, rows: int) -> float:
        """The experts term: expected touched experts (one MoE layer) x a_expert."""
        if not self._a_expert:
            return 0.0
        value = self._expert_cache.get((tokens, rows))
        if value is None:
            value = self._expert_cache[(tokens, rows)] = \
                self._a_expert * self.layout.experts_touched(tokens, rows)
        return value

    def decode_run_values(self, run, shared):
        """(forward_values, around_values) of a decode run's steps k = 1, 2, ... (a generator;
        simkv.engine.decode_run): the same floats as for each step's plan, with only the decode
        context, the longest one, the decode tail and the shared reads (`shared(k)`; None:
        none) moving."""
        n = run.n
        layout = self.layout
        graph = n <= self._max_graph
        rows = self._graph_rows[n] if graph else n
        linear = self._linear_cache.get(rows)
        if linear is None:
            linear = self._linear_cache[rows] = self._linear(rows)
        per_token = self.decode_token_seconds(n)
        first_share, further_share = self._shared_saving_first, self._shared_saving_further
        tails = layout.decode_run_tail(run.starts, graph, self.block_size) if self._a_long \
            else None
        a_long = self._a_long
        z_pairs, z_context = self._a_pf * 0, self._a_ctx * 0
        per_seq = self._c_seq * n
        experts = self._experts(n, rows)           # the same tokens every step
        around = self.around_values(run.plan)      # the same n, no prefill, copy or swap
        context0 = run.context_tokens - n
        c_eager, host_floor = self._c_eager, self._h0 + self._h_seq * n
        k, saving, tail = 1, 0.0, 0.0
        while True:
            decode = per_token * (context0 + n * k)
            if shared is not None:
                repeats, first = shared(k)
                saving = -per_token * (first_share * first + further_share * (repeats - first)) \
                    if repeats else 0.0
            if tails is not None:
                tail = a_long * next(tails)
            if graph:
                yield (linear, decode, saving, tail, z_pairs, z_context, 0.0, per_seq, 0.0, 0.0,
                       0.0, experts, 0.0, 0.0), around
            else:
                values = (linear, decode, saving, tail, z_pairs, z_context, 0.0, per_seq, 0.0,
                          0.0, 0.0, experts)
                floor = host_floor - math.fsum(values) - c_eager
                yield values + (c_eager, max(0.0, floor)), around
            k += 1

    def decode_run_split(self, run, shared):
        """A graphed decode run's terms, split into what every step shares and what moves:
        (forward partials, step partials, the around terms' sum, varying), where `varying`
        yields each step's decode, saving and tail terms (those that are not always zero) from
        step 1 on. `fsum(forward partials + varying terms)` is the step's `fsum(forward_values)`
        and `fsum(step partials + varying terms)` its forward and around terms' sum, exactly
        (exact_partials). The partials are kept per batch and around terms and shared between
        runs: callers add to copies, never to them. None for an eager batch (its host floor
        moves with the sum)."""
        n = run.n
        if n > self._max_graph:
            return None
        around_values = self.around_values(run.plan)
        sums = self._run_constants.get((n, around_values))
        if sums is None:
            rows = self._graph_rows[n]
            linear = self._linear_cache.get(rows)
            if linear is None:
                linear = self._linear_cache[rows] = self._linear(rows)
            constant = (linear, self._a_pf * 0, self._a_ctx * 0, self._c_seq * n)
            if self._a_expert:          # a MoE model's experts: the same tokens every step
                constant += (self._experts(n, rows),)
            sums = self._run_constants[(n, around_values)] = (
                exact_partials(constant), exact_partials(constant + around_values),
                math.fsum(around_values))
        return sums + (self._decode_run_varying(run, shared),)

    def _decode_run_varying(self, run, shared):
        """decode_run_split's varying terms, step by step (as decode_run_values has them)."""
        n = run.n
        per_token = self.decode_token_seconds(n)
        first_share, further_share = self._shared_saving_first, self._shared_saving_further
        a_long = self._a_long
        tails = self.layout.decode_run_tail_segments(run.starts, True, self.block_size) \
            if a_long else None
        context, k = run.context_tokens - n, 1
        tail, tail_until = 0.0, 1
        while True:
            terms = [per_token * (context + n * k)]
            if shared is not None:
                repeats, first = shared(k)
                if repeats:
                    terms.append(-per_token * (first_share * first
                                               + further_share * (repeats - first)))
            if tails is not None:
                if k == tail_until:
                    tokens, tail_until = next(tails)
                    tail = a_long * tokens
                terms.append(tail)
            yield terms
            k += 1

    def decode_run_seconds(self, run, shared, now_s: float, horizon_s: float) -> list:
        """Seconds of a decode run's steps (CostModelExecutor.run_seconds), in closed form."""
        fsum = math.fsum
        split = self.decode_run_split(run, shared)
        if split is None:
            sums = (fsum(forward + around)
                    for forward, around in self.decode_run_values(run, shared))
        else:
            _, constant, _, varying = split
            sums = (fsum(constant + terms) for terms in varying)
        out = []
        for k in range(1, run.max_steps + 1):
            if k > 1 and now_s >= horizon_s:     # step 1 is scheduled
                break
            seconds = next(sums)
            out.append(seconds)
            now_s = now_s + seconds
        return out

    def term_values(self, plan) -> tuple:
        return self.forward_values(plan) + self.around_values(plan)

    def host_seconds(self, plan) -> float:
        """The engine's host time around a step (scheduling, finishing it, metrics: outside the
        executor's span), from the profile's serving pass where it has one, else from its
        offline engine pass; 0 without either or with the engine_host effect off."""
        if not plan.scheduled or not self.engine_host_on:
            return 0.0
        if self.serving_host is not None:
            return engine_host_seconds(self.serving_host["outside"], len(plan.scheduled),
                                       plan.num_prefill_tokens)
        if self.engine_host is None:
            return 0.0
        return engine_host_seconds(self.engine_host, len(plan.scheduled),
                                   plan.num_prefill_tokens)

    def prep_delta_seconds(self, plan) -> float:
        """The host input preparation inside the executor's span as served (the serving pass)
        less what the profiled times hold of it (the grid's); 0 without both."""
        serving = self.serving_host
        if serving is None or "grid_prep" not in serving or not plan.scheduled \
                or not self.engine_host_on:
            return 0.0
        n, tokens = len(plan.scheduled), plan.num_prefill_tokens
        return engine_host_seconds(serving["prep"], n, tokens) \
            - engine_host_seconds(serving["grid_prep"], n, tokens)

    def around_values(self, plan) -> tuple:
        """The terms of a step outside its profiled forward pass (AROUND_TERMS): the engine's
        host time, the serving pass's input preparation less the grid's, block copies, swaps."""
        copies = swap_out = swap_in = 0.0
        if plan.block_copies and self.copy is not None:
            copies = transfer_seconds(self.copy, len(plan.block_copies), self.bytes_per_block)
        if plan.swap_out and "out" in self.swap:
            swap_out = transfer_seconds(self.swap["out"], len(plan.swap_out),
                                        self.bytes_per_block)
        if plan.swap_in and "in" in self.swap:
            swap_in = transfer_seconds(self.swap["in"], len(plan.swap_in), self.bytes_per_block)
        return (self.host_seconds(plan), self.prep_delta_seconds(plan), copies, swap_out,
                swap_in)

    def around_seconds(self, plan) -> float:
        """Seconds of a step outside its profiled forward pass (`around_values`, summed)."""
        return math.fsum(self.around_values(plan))

    def describe(self) -> dict:
        """What this model is: source, block size (and interpolation), coefficients, errors."""
        fit = self.fit
        return {
            "name": self.name,
            "estimate": False,
            "path": str(self.path),
            "block_size": self.block_size,
            "kv_dtype": self.kv_dtype,
            "profiled_block_sizes": self.block_sizes,
            "interpolated": self.block_size not in self.step,
            "notes": list(self.notes),
            "form": fit.get("form"),
            "formula": fit.get("formula"),
            "coefficients": self.coefs,
            "engine_host": self.engine_host,
            "serving_host": self.serving_host,
            "shared_reads": self.shared_reads,
            "holdout_error": fit.get("holdout_error", {}),
        }
