"""Iteration-level (continuous batching) scheduler, shared by the simulator and the real engine.

`schedule(now)` decides what one step computes and returns a StepPlan; `finish_step(plan, outputs,
now)` applies its results. Running requests are served first (decodes and unfinished chunked
prefills), then swapped requests are resumed, then waiting ones are admitted first come, first
served. Whether tokens fit in memory is the KV manager's answer; who runs is decided here.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from array import array
from collections import deque

from simkv.engine.kv.hashing import hash_root
from simkv.engine.plan import ScheduledSeq, StepPlan
from simkv.engine.request import Request, RequestStatus, Sequence


class Scheduler:
    def __init__(self, kv, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 enable_chunked_prefill: bool = True, long_prefill_token_threshold: int = 0,
                 max_model_len: int = 32768, preemption_mode: str = "recompute",
                 preemption_policy: str = "recent", global_prefix_scope: bool = False,
                 policy: str = "fcfs", reserve_full_prompt: bool = False,
                 parallel_sampling: str = "fork", cap_output_tokens: bool = False,
                 max_loras: int | None = None):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.max_model_len = max_model_len
        self.preemption_mode = preemption_mode
        self.preemption_policy = preemption_policy
        self.global_prefix_scope = global_prefix_scope
        # vLLM's rules (docs/semantics.md): the defaults are semantics vllm-0.18's
        self.policy = policy                          # fcfs | priority
        self.reserve_full_prompt = reserve_full_prompt
        self.parallel_sampling = parallel_sampling    # fork | fanout
        self.cap_output_tokens = cap_output_tokens
        self.max_loras = max_loras
        if policy == "priority":
            self.preemption_policy = "priority"

        self.waiting: deque = deque()     # Request, FCFS; recompute-preempted ones at the front
        self.swapped: deque = deque()     # Request, resumed before new admissions
        self.running: list = []           # Request, in admission order
        self.requests: dict = {}          # request_id -> live Request
        self.done: list = []              # final requests (completed, cancelled, rejected)
        self.num_running_seqs = 0
        self.step_id = 0
        self.itl_s = array("d")           # gaps between consecutive tokens of a sequence
        self.num_preemptions = 0
        self.num_swap_fallbacks = 0       # swap preemptions that fell back to recompute
        self.num_capped = 0               # requests whose output was cut at max_model_len
        self._next_seq_id = 0
        self._cancel_ids: list = []
        self._rejected: list = []
        self._stop_running = False        # a request preempted itself under policy priority
        self.has_turns = False            # a request continues an earlier one (decode runs)
        self._sampled: list = []          # the launched step's items that sample (launch_step)
        # prefill/decode disaggregation (simkv.sim.cluster): a prefill replica keeps a finished
        # request's blocks until its KV is sent; a decode replica holds blocks for prompts
        # whose KV is on its way
        self.hold_finished_blocks = False
        self.held: dict = {}              # request id -> finished sequences whose blocks are kept
        self.receiving: dict = {}         # request id -> request whose prompt KV is arriving

    # -- requests in and out ------------------------------------------------------------------
    def add_request(self, req: Request, now: float = 0.0) -> None:
        """Queue a request, or reject it now if it can never be served (the reason is kept).

        With `parallel_sampling` fanout, a request with n > 1 becomes n child requests of one
        sample each, as vLLM v1 serves it (vllm/v1/engine/parallel_sampling.py, ParentRequest):
        they share the prompt only through the prefix cache, are admitted and preempted on
        their own, and make one row together (`_close_group`)."""
        req.hash_root = hash_root(req, self.global_prefix_scope)
        if req.parent is not None:
            self.has_turns = True
        if self.cap_output_tokens and req.prompt_tokens < self.max_model_len \
                and req.prompt_tokens + req.output_tokens > self.max_model_len:
            # vLLM stops a sequence when it reaches max_model_len tokens
            # (vllm/v1/core/sched/utils.py, check_stop: FINISHED_LENGTH_CAPPED)
            req.capped_tokens = req.prompt_tokens + req.output_tokens - self.max_model_len
            req.output_tokens -= req.capped_tokens
            self.num_capped += 1
        fanout = req.n > 1 and self.parallel_sampling == "fanout"
        reason = self._why_unservable(req, 1 if fanout else req.n)
        if reason:
            req.status = RequestStatus.REJECTED
            req.reason = reason
            req.finish_s = now
            self._rejected.append(req)
            self.done.append(req)
            return
        self.requests[req.request_id] = req
        req.status = RequestStatus.WAITING
        if not fanout:
            self._queue(req)
            return
        req.children = []
        for sample in range(req.n):
            child = dataclasses.replace(req, n=1, sample=sample, group=req, seqs=[],
                                        all_seqs=[], children=None, capped_tokens=0)
            req.children.append(child)
            self._queue(child)

    def _queue(self, req: Request) -> None:
        """A new request (or a fanned-out child) into the waiting queue."""
        seq = self._new_seq(req, req.sample, req.prompt_tokens)
        if req.prompt_token_ids is not None:
            seq.token_ids = list(req.prompt_token_ids)
        self._wait(req)

    def _wait(self, req: Request, front: bool = False) -> None:
        """Into the waiting queue: at the back (new) or the front (preempted) under fcfs; in
        (priority, arrival) order under priority, as vLLM's PriorityRequestQueue
        (vllm/v1/core/sched/request_queue.py) orders it."""
        if self.policy == "priority":         # after every request with a key <= req's
            bisect.insort_right(self.waiting, req, key=_priority_key)
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _why_unservable(self, req: Request, n: int) -> str:
        if self.cap_output_tokens:
            # vLLM rejects a prompt that leaves no room for one output token
            # (vllm/v1/engine/input_processor.py, InputProcessor._validate_prompt_len)
            if req.prompt_tokens >= self.max_model_len:
                return (f"prompt {req.prompt_tokens} tokens reach max_model_len "
                        f"{self.max_model_len}")
        elif req.max_tokens > self.max_model_len:
            return (f"prompt {req.prompt_tokens} + output {req.output_tokens} tokens exceed "
                    f"max_model_len {self.max_model_len}")
        if not self.enable_chunked_prefill and req.max_tokens > self.max_num_batched_tokens:
            return (f"{req.max_tokens} tokens cannot be prefilled in one step of "
                    f"{self.max_num_batched_tokens} tokens with chunked prefill off")
        need = self.kv.blocks_needed(req.max_tokens, n, req.prompt_tokens)
        if need > self.kv.max_admissible_blocks():
            return (f"needs {need} KV blocks; the pool admits at most "
                    f"{self.kv.max_admissible_blocks()}")
        if n > self.max_num_seqs:
            return f"n={n} exceeds max_num_seqs {self.max_num_seqs}"
        return ""

    def cancel(self, request_id: int) -> None:
        """Cancel a request; its resources are freed at the next step boundary."""
        self._cancel_ids.append(request_id)

    def has_pending_events(self) -> bool:
        """Cancellations or rejections that the next step applies."""
        return bool(self._cancel_ids) or bool(self._rejected)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._cancel_ids) or bool(self._rejected)

    def _new_seq(self, req: Request, sample: int, num_tokens: int) -> Sequence:
        seq = Sequence(self._next_seq_id, req, sample, num_tokens)
        self._next_seq_id += 1
        req.seqs.append(seq)
        req.all_seqs.append(seq)
        return seq

    # -- one step -----------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        """Decide the next step. An empty plan means there is nothing to run now."""
        self.step_id += 1
        plan = StepPlan(self.step_id, now)
        if self._cancel_ids:
            self._apply_cancels(plan, now)
        if self._rejected:
            plan.rejected = [r.request_id for r in self._rejected]
            self._rejected = []
        budget = self._schedule_running(plan, self.max_num_batched_tokens)
        if not plan.preempted:
            self._resume_swapped(plan)
            if not self.swapped:
                self._admit_waiting(plan, now, budget)
        self._finalise(plan)
        return plan

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        """Running requests first, in admission order, preempting when slots run out; returns
        the token budget left."""
        scheduled = plan.scheduled
        append = scheduled.append
        running = self.running
        kv = self.kv
        allocate = kv.allocate_slots
        # a paged manager's test for a decode token that lands in the sequence's own partial
        # tail block (its allocate_slots' first case), made here without the call
        in_place = getattr(kv, "tail_append", None)
        bs, ref_cnt, cache_full = in_place() if in_place is not None else (0, None, None)
        last = bs - 1
        i = 0
        count = len(running)
        while i < count and budget > 0:
            # the common case, one-sequence decodes, without ceremony, up to the first other
            # request (or one whose token finds no slot: _schedule_request preempts for it)
            mark = len(scheduled)
            for req in running[i:i + budget]:
                seqs = req.seqs
                if len(seqs) != 1:
                    break
                seq = seqs[0]
                computed = seq.num_computed_tokens
                if seq.num_tokens - computed != 1 or computed < req.prompt_tokens:
                    break
                if bs:
                    r = computed % bs
                    if r:
                        table = seq.block_table
                        if len(table) == computed // bs + 1 and ref_cnt[table[-1]] == 1:
                            if r == last and cache_full is not None:
                                cache_full(seq, computed + 1)
                            append(ScheduledSeq(seq, computed, 1, True))
                            continue
                if not allocate(seq, 1):
                    break
                append(ScheduledSeq(seq, computed, 1, True))
            done = len(scheduled) - mark
            i += done
            budget -= done
            if i >= count or budget <= 0:
                break
            i, budget = self._schedule_request(plan, running[i], i, budget)
            count = len(running)
            if self._stop_running:
                self._stop_running = False
                break
        return budget

    def _chunk(self, num_new: int, budget: int) -> int | None:
        """Prompt tokens of a prefill this step: at most long_prefill_token_threshold and at
        most the token budget; None when they exceed the budget and chunked prefill is off."""
        threshold = self.long_prefill_token_threshold
        if threshold and num_new > threshold:
            num_new = threshold
        if num_new > budget:
            if not self.enable_chunked_prefill:
                return None
            num_new = budget
        return num_new

    def _schedule_request(self, plan: StepPlan, req: Request, i: int, budget: int) -> tuple:
        """The sequences of running request `req` (index `i`): decodes and prefill chunks.
        Returns (index of the next running request, token budget left)."""
        kv = self.kv
        scheduled = plan.scheduled
        seqs = req.seqs
        mark = len(scheduled)         # this request's items start here
        preempted_self = False
        for seq in seqs:
            computed = seq.num_computed_tokens
            num_new = seq.num_tokens - computed
            if num_new == 0 or (computed == 0 and seq is not seqs[0]):
                continue              # a sample waiting to re-fork from the first (_refork)
            if num_new > 1:
                num_new = self._chunk(num_new, budget)
                if num_new is None:
                    continue
            if budget <= 0:
                break
            while not kv.allocate_slots(seq, num_new):
                victim, index = self._preempt(plan)
                if victim is req:
                    preempted_self = True
                    break
                if index < i:              # priority policy: a request already served this step
                    i -= 1
                    mark -= sum(1 for item in plan.scheduled if item.seq.request is victim)
                    budget += self._unschedule(plan, victim)
            if preempted_self:
                break
            scheduled.append(ScheduledSeq(seq, computed, num_new,
                                          num_new == 1 and computed >= req.prompt_tokens))
            budget -= num_new
        if preempted_self:            # its items leave the plan; running shrank under us
            for item in scheduled[mark:]:
                budget += item.num_tokens
            del scheduled[mark:]
            # vLLM ends the pass over running requests there (vllm/v1/core/sched/scheduler.py,
            # Scheduler.schedule: "Cannot schedule this request"); the victim was the last one
            # under fcfs, so only the priority policy sees a difference
            self._stop_running = self.policy == "priority"
            return i, budget
        return i + 1, budget

    def _admit_waiting(self, plan: StepPlan, now: float, budget: int) -> None:
        kv = self.kv
        waiting = self.waiting
        adapters = self._step_adapters(plan) if self.max_loras else None
        skipped = []                  # passed over for the adapter limit, kept in order
        while waiting and budget > 0:
            req = waiting[0]
            if self.num_running_seqs + _seats(req) > self.max_num_seqs:
                break
            if adapters is not None and req.adapter and req.adapter not in adapters \
                    and len(adapters) >= self.max_loras:
                # vLLM skips a request whose adapter would exceed max_loras this step and
                # looks at the next (vllm/v1/core/sched/scheduler.py, Scheduler.schedule)
                skipped.append(waiting.popleft())
                continue
            items = []
            admitted = []
            # Fix: a forked request preempted for recompute used to re-prefill every sample from
            # scratch, all admitted at once: n copies of the prompt (no sharing without prefix
            # caching, or past the first chunk), which could exceed the pool for ever (the
            # simulator stopped with "requests wait but nothing can run"). Only the first sample
            # is prefilled; the others re-fork from it once it has the prompt (_refork).
            to_admit = req.seqs[:1]
            for seq in to_admit:
                cached_blocks, cached_tokens = kv.prefix_lookup(seq)
                num_new = seq.num_tokens - seq.num_computed_tokens - cached_tokens
                num_new = self._chunk(num_new, budget)
                if num_new is None:
                    break
                # the full-prompt gate: blocks for every token still to prefill must be free
                # now, though only this step's chunk takes them (docs/semantics.md)
                reserve = seq.num_tokens if self.reserve_full_prompt else 0
                if not kv.allocate_slots(seq, num_new, cached_blocks, admission=True,
                                         reserve_tokens=reserve):
                    break
                admitted.append((seq, cached_tokens))
                seq.num_computed_tokens += cached_tokens
                if num_new:
                    items.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new, False))
                budget -= num_new
            if len(admitted) < len(to_admit):       # all of them, or none
                # Fix: free while the hit still counts as computed, the last admitted first, so
                # that the KV manager un-hashes exactly the blocks this admission allocated and
                # nobody computed (a sibling may have hit them in this same admission). With one
                # sequence admitted at a time this is general, not needed.
                for seq, cached_tokens in reversed(admitted):
                    kv.free(seq)
                    seq.num_computed_tokens -= cached_tokens
                break
            waiting.popleft()
            for seq, cached_tokens in admitted:
                req.cached_tokens += cached_tokens
                req.queried_tokens += seq.num_tokens
            hit = sum(c for _, c in admitted)
            if req.first_hit_tokens < 0:
                req.first_hit_tokens = hit
            elif hit > req.first_hit_tokens:    # its own blocks, back after a preemption
                req.self_rehit_tokens += hit - req.first_hit_tokens
            if req.lost_tokens:
                req.recomputed_tokens += max(0, req.lost_tokens - sum(c for _, c in admitted))
                req.lost_tokens = 0
            if math.isnan(req.admitted_s):
                req.admitted_s = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.num_running_seqs += _seats(req)
            plan.scheduled.extend(items)
            if adapters is not None and req.adapter:
                adapters.add(req.adapter)
        if skipped:
            waiting.extendleft(reversed(skipped))

    @staticmethod
    def _step_adapters(plan: StepPlan) -> set:
        """The adapters of the requests this step serves so far."""
        return {item.seq.request.adapter for item in plan.scheduled if item.seq.request.adapter}

    def _resume_swapped(self, plan: StepPlan) -> None:
        """Swapped requests back in, oldest first, while seats and blocks allow."""
        swapped = self.swapped
        while swapped:
            req = swapped[0]
            if self.num_running_seqs + _seats(req) > self.max_num_seqs:
                break
            mapping = self.kv.swap_in(req.seqs)
            if mapping is None:
                break
            swapped.popleft()
            plan.swap_in.extend(mapping)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.num_running_seqs += _seats(req)

    def _preempt(self, plan: StepPlan) -> tuple:
        """Take a victim off the running list: swap it out, or free it to be recomputed.
        Returns the victim and the index it had in the running list."""
        running = self.running
        if self.preemption_policy == "priority":
            victim = max(running, key=lambda r: (r.priority, r.arrival_s, r.request_id))
            index = running.index(victim)
        else:
            victim, index = running[-1], len(running) - 1
        del running[index]
        self.num_running_seqs -= _seats(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted.append(victim.request_id)
        if self.preemption_mode == "swap":
            mapping = self.kv.swap_out(victim.seqs)
            if mapping is not None:
                plan.swap_out.extend(mapping)
                victim.status = RequestStatus.SWAPPED
                self.swapped.append(victim)
                return victim, index
            self.num_swap_fallbacks += 1
        for k, seq in enumerate(victim.seqs):
            self.kv.free(seq)
            # the other samples will share the first one's prompt again (_refork)
            victim.lost_tokens += seq.num_computed_tokens if k == 0 else \
                max(0, seq.num_computed_tokens - victim.prompt_tokens)
            seq.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self._wait(victim, front=True)
        return victim, index

    @staticmethod
    def _unschedule(plan: StepPlan, victim: Request) -> int:
        """Drop a preempted request's work from this step's plan; returns the tokens freed."""
        kept, freed = [], 0
        for item in plan.scheduled:
            if item.seq.request is victim:
                freed += item.num_tokens
            else:
                kept.append(item)
        plan.scheduled[:] = kept
        return freed

    def _apply_cancels(self, plan: StepPlan, now: float) -> None:
        for request_id in self._cancel_ids:
            req = self.requests.get(request_id)
            if req is None:
                continue              # already finished, rejected or unknown
            for part in req.children or (req,):
                if part.is_final:
                    continue
                if part.status == RequestStatus.RUNNING:
                    self.running.remove(part)
                    self.num_running_seqs -= _seats(part)
                elif part.status == RequestStatus.SWAPPED:
                    self.swapped.remove(part)
                else:
                    self.waiting.remove(part)
                for seq in part.seqs:
                    self.kv.free(seq)
                part.status = RequestStatus.CANCELLED
                part.finish_s = now
            plan.cancelled.append(request_id)
            self._close(req)
        self._cancel_ids = []

    def _close(self, req: Request) -> None:
        """A request (or a fanned-out child) is final: its row is kept in `done`; a child's
        request closes once every child is final."""
        group = req.group
        if group is None:
            if req.children:
                self._close_group(req)
            del self.requests[req.request_id]
            self.done.append(req)
        elif all(child.is_final for child in group.children) and not group.is_final:
            self._close(group)

    @staticmethod
    def _close_group(req: Request) -> None:
        """A fanned-out request's row from its children: TTFT to the first child's first
        token, E2E to the last child's finish, output tokens summed, TPOT their mean; it is
        completed when every child completed, else cancelled."""
        children = req.children
        completed = all(c.status == RequestStatus.COMPLETED for c in children)
        req.status = RequestStatus.COMPLETED if completed else RequestStatus.CANCELLED
        req.first_token_s = min((c.first_token_s for c in children
                                 if c.first_token_s == c.first_token_s), default=math.nan)
        req.admitted_s = min((c.admitted_s for c in children
                              if c.admitted_s == c.admitted_s), default=math.nan)
        req.finish_s = max(c.finish_s for c in children)
        req.output_tokens = sum(seq.num_output_tokens for c in children for seq in c.all_seqs)
        for name in ("num_preemptions", "cached_tokens", "queried_tokens", "recomputed_tokens",
                     "self_rehit_tokens"):
            setattr(req, name, sum(getattr(c, name) for c in children))
        tpots = [(c.finish_s - c.first_token_s) / (c.output_tokens - 1) for c in children
                 if c.status == RequestStatus.COMPLETED and c.output_tokens > 1]
        req.tpot_s = sum(tpots) / len(tpots) if tpots else math.nan
        req.all_seqs = [seq for c in children for seq in c.all_seqs]

    def _finalise(self, plan: StepPlan) -> None:
        """The plan's token counts, block copies and the state snapshot."""
        plan.count_tokens()
        if self.kv.copies:
            plan.block_copies = self.kv.take_copies()
        plan.num_running = len(self.running)
        plan.num_waiting = len(self.waiting) + len(self.swapped)
        plan.kv_blocks_used = self.kv.num_used_blocks
        plan.kv_blocks_free = self.kv.num_free_blocks

    # -- after the step -----------------------------------------------------------------------
    def finish_step(self, plan: StepPlan, outputs: dict | None = None, now: float = 0.0) -> None:
        """Apply a step's results at its end time `now`: computed tokens, sampled tokens (the
        real engine passes seq_id -> token id; the simulator passes None), forks, finishes."""
        gap = self.itl_s.append
        for item in plan.scheduled:
            seq = item.seq
            req = seq.request
            computed = seq.num_computed_tokens + item.num_tokens
            seq.num_computed_tokens = computed
            several = req.n > 1
            if several and len(req.seqs) > 1 and req.seqs[-1].num_computed_tokens == 0 \
                    and computed >= req.prompt_tokens:
                self._refork(plan, req, seq)
            if computed < seq.num_tokens:
                continue                      # a prefill chunk: no token yet
            if outputs is not None:
                seq.token_ids.append(outputs[seq.seq_id])
            seq.num_tokens += 1
            out = seq.num_output_tokens + 1
            seq.num_output_tokens = out
            if out > 1:
                gap(now - seq.last_token_s)
            elif req.first_token_s != req.first_token_s:
                req.first_token_s = now       # first token of the request (NaN check)
            seq.last_token_s = now
            if several and len(req.all_seqs) == 1:
                self._fork(plan, req, seq)
            if out >= req.output_tokens:
                self._finish_seqs(req, now)

    # -- asynchronous scheduling: the next step is scheduled while this one runs -------------
    def launch_step(self, plan: StepPlan) -> None:
        """The step is launched and the next one will be scheduled before its outputs come
        back, as vLLM v0.26's AsyncScheduler does (vllm/v1/core/sched/async_scheduler.py): its
        tokens count as computed now, and a sequence that samples a token that is not its last
        gets a placeholder for it (num_tokens + 1), which the next step decodes. One whose last
        token this is gets none: it is not scheduled again but keeps its seat and blocks until
        `finish_launched_step`, as vLLM's running loop skips a request whose placeholders reach
        max_tokens. No timestamps: the tokens exist only when the step ends."""
        sampled = []
        for item in plan.scheduled:
            seq = item.seq
            computed = seq.num_computed_tokens + item.num_tokens
            seq.num_computed_tokens = computed
            if computed >= seq.num_tokens:
                sampled.append(item)
                if seq.num_output_tokens + 1 < seq.request.output_tokens:
                    seq.num_tokens += 1
        self._sampled = sampled

    def finish_launched_step(self, plan: StepPlan, outputs: dict | None = None,
                             now: float = 0.0) -> None:
        """Apply a launched step's results at its end time `now`: the tokens it sampled (their
        times, gaps and first tokens), and the finishes, which free seats and blocks. A request
        cancelled meanwhile gets nothing (vLLM drops its output); one preempted meanwhile keeps
        its token (vLLM appends it in update_from_output) and finishes from the waiting queue if
        it was its last."""
        itl = self.itl_s
        sampled, self._sampled = self._sampled, []
        for item in sampled:
            seq = item.seq
            req = seq.request
            if req.is_final:
                continue
            if outputs is not None:
                seq.token_ids.append(outputs[seq.seq_id])
            out = seq.num_output_tokens + 1
            seq.num_output_tokens = out
            if out > 1:
                itl.append(now - seq.last_token_s)
            elif req.first_token_s != req.first_token_s:
                req.first_token_s = now
            seq.last_token_s = now
            if out >= req.output_tokens:
                seq.num_tokens += 1           # the last token had no placeholder
                if req.status == RequestStatus.WAITING:
                    self._finish_preempted(req, now)
                else:
                    self._finish_seqs(req, now)

    def _finish_preempted(self, req: Request, now: float) -> None:
        """A request preempted while its last token was computed is complete: out of the
        waiting queue (vllm/v1/core/sched/scheduler.py, update_from_output: stopped preempted
        requests); its seat and blocks were given back when it was preempted."""
        self.waiting.remove(req)
        for seq in req.seqs:
            seq.finished = True
            seq.block_hashes = []
        req.seqs = []
        req.status = RequestStatus.COMPLETED
        req.finish_s = now
        self._close(req)

    def _fork(self, plan: StepPlan, req: Request, parent: Sequence) -> None:
        """The prompt is done: n sampling sequences share its blocks (copy-on-write later)."""
        for sample in range(1, req.n):
            child = self._new_seq(req, sample, parent.num_tokens)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_output_tokens = parent.num_output_tokens
            child.last_token_s = parent.last_token_s
            if parent.token_ids is not None:
                child.token_ids = list(parent.token_ids)
            self.kv.fork(parent, child)
            plan.forked.append((parent.seq_id, child.seq_id))

    def _refork(self, plan: StepPlan, req: Request, first: Sequence) -> None:
        """After a recompute, the first sample has the prompt again: the others share its prompt
        blocks and prefill only their own outputs."""
        for seq in req.seqs[1:]:
            self.kv.fork(first, seq, req.prompt_tokens)
            seq.num_computed_tokens = req.prompt_tokens
            plan.forked.append((first.seq_id, seq.seq_id))

    def _finish_seqs(self, req: Request, now: float) -> None:
        for seq in list(req.seqs):
            if seq.num_output_tokens >= req.output_tokens:
                if self.hold_finished_blocks:
                    self.held.setdefault(req.request_id, []).append(seq)
                else:
                    self.kv.free(seq)
                seq.finished = True
                seq.block_hashes = []
                req.seqs.remove(seq)
                self.num_running_seqs -= 1
        if not req.seqs:
            req.status = RequestStatus.COMPLETED
            req.finish_s = now
            self.running.remove(req)
            self._close(req)


    # -- prefill/decode disaggregation ----------------------------------------------------------
    def release_held(self, request_id: int) -> None:
        """Free the blocks kept for a finished request (`hold_finished_blocks`): its KV is sent."""
        for seq in self.held.pop(request_id, ()):
            self.kv.free(seq)

    def receive_prompt(self, req: Request, now: float) -> bool:
        """Take a seat and blocks for the whole prompt of `req`, whose KV another replica
        computed and sends: all or nothing (the watermark kept free); False changes nothing.
        The request waits, unscheduled, until `prompt_received`, as vLLM's
        WAITING_FOR_REMOTE_KVS."""
        if req.prompt_tokens > self.max_model_len \
                or self.num_running_seqs + len(self.receiving) >= self.max_num_seqs:
            return False
        req.hash_root = hash_root(req, self.global_prefix_scope)
        seq = Sequence(self._next_seq_id, req, 0, req.prompt_tokens)
        if not self.kv.allocate_slots(seq, req.prompt_tokens, admission=True):
            return False
        self._next_seq_id += 1
        req.seqs.append(seq)
        req.all_seqs.append(seq)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.receiving[req.request_id] = req
        return True

    def prompt_received(self, request_id: int, now: float) -> None:
        """The prompt's KV is here: all but its last token count as computed (the last one is
        computed again for its logits, as vLLM's _update_waiting_for_remote_kv does) and the
        request runs from the next step. It is admitted at once, not queued: it holds its
        blocks already, and a request that holds blocks in the waiting queue could stall a
        pool behind a preempted one that needs them."""
        req = self.receiving.pop(request_id)
        seq = req.seqs[0]
        seq.num_computed_tokens = req.prompt_tokens - 1
        req.queried_tokens += seq.num_tokens
        req.admitted_s = now
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.num_running_seqs += 1

    def park_waiting(self) -> list:
        """Take every waiting request out of the queue (in order): none can be admitted until
        blocks kept for transfers are freed, and the serving loop must idle, not stop."""
        parked = list(self.waiting)
        self.waiting.clear()
        return parked

    def unpark_waiting(self, parked: list) -> None:
        """Put requests taken by `park_waiting` back at the front of the queue, in order."""
        self.waiting.extendleft(reversed(parked))


def _priority_key(req: Request) -> tuple:
    """Order under policy priority: lower priority value first, then earlier arrival."""
    return (req.priority, req.arrival_s, req.request_id, req.sample)


def _seats(req: Request) -> int:
    """Sequences a request counts against max_num_seqs: its live samples plus those it will fork
    once its prompt is done (reserved at admission, so that forking never overflows the limit)."""
    return len(req.seqs) + req.n - len(req.all_seqs)
