"""Decode runs: the steps after a plain decode step, taken together.

A step that decoded every running sequence and did nothing else (no prefill chunk, admission,
preemption, copy, swap, fork or finish) is followed by the same step one token further on, for
as long as nothing changes the batch: until an arrival or a cancellation (the driver's
horizon), a sequence's last token, or the pool running out of free blocks. Such a run's steps
are known before they are taken: sequence i of the batch computes token c_i + k - 1 in step k
(c_i: its computed tokens as the run starts), takes a block where that token opens one and
registers a block where it fills one (the KV manager's `append_decode_tokens`, as `m` steps of
`allocate_slots(seq, 1)` would). The serving loop (simkv.engine.loop) asks for a run after
each step; the executor times its steps (a cost model can do so in closed form), and `commit`
applies them to the scheduler, the KV manager and the recorder: the same state, rows and
floats as taking the steps one by one (tests/test_decode_run.py).

Why the batch does not change inside a run: what the step before left waiting stays waiting.
The head of the queue was refused a seat, the token budget or blocks, and none of those comes
back inside a run (seats and budget are constant, free blocks only fall, a decode never fills
a block another request's prompt could hit); swapped requests likewise.
"""
from __future__ import annotations

from array import array

from simkv.engine.plan import ScheduledSeq, StepPlan

MAX_RUN_STEPS = 4096       # steps one run covers at most (it is planned before it is timed)


class DecodeRun:
    """Steps 1..m after `plan` (step 0), each decoding every sequence of the batch once more.

    `seqs` (plan order), `starts` (c_i: the token each computes in step 1), `n`,
    `context_tokens` and `max_context` (step 1's decode context, summed and longest; step k
    adds n x (k - 1) and k - 1), `max_steps` (the run ends before a sequence's last token and
    before the pool runs out)."""

    def __init__(self, scheduler, plan: StepPlan):
        self.scheduler, self.plan = scheduler, plan
        self.seqs = [item.seq for item in plan.scheduled]
        self.starts = [seq.num_computed_tokens for seq in self.seqs]
        self.n = len(self.seqs)
        self.context_tokens = sum(self.starts) + self.n
        self.max_context = max(self.starts) + 1
        self.block_size = scheduler.kv.block_size
        self.max_steps = self._max_steps()

    # -- bounds -------------------------------------------------------------------------------
    def _max_steps(self) -> int:
        """Steps before a sequence's last token, cut where the pool's free blocks run out."""
        steps = min(seq.request.output_tokens - seq.num_output_tokens for seq in self.seqs) - 1
        steps = min(steps, MAX_RUN_STEPS)
        if steps <= 0:
            return 0
        free = self.scheduler.kv.num_free_blocks
        if self.blocks_taken(steps) <= free:
            return steps
        low, high = 0, steps            # blocks_taken(low) <= free < blocks_taken(high)
        while high - low > 1:
            mid = (low + high) // 2
            if self.blocks_taken(mid) <= free:
                low = mid
            else:
                high = mid
        return low

    def blocks_taken(self, steps: int) -> int:
        """Blocks the batch takes in steps 1..`steps`: one where a token opens a block."""
        bs = self.block_size
        total = 0
        for c in self.starts:
            first = (-c) % bs + 1        # the first step whose token opens a block
            if steps >= first:
                total += (steps - first) // bs + 1
        return total

    # -- the steps, as plans ------------------------------------------------------------------
    def plan_at(self, k: int, now_s: float) -> StepPlan:
        """Step k of the run as the scheduler would plan it (the KV snapshot left out)."""
        first = self.plan
        plan = StepPlan(first.step + k, now_s,
                        [ScheduledSeq(seq, c + k - 1, 1, True)
                         for seq, c in zip(self.seqs, self.starts)])
        plan.count_tokens()
        plan.num_running, plan.num_waiting = first.num_running, first.num_waiting
        return plan

    # -- applying it --------------------------------------------------------------------------
    def commit(self, ends: list, recorder) -> None:
        """Apply steps 1..m, step k running from ends[k - 1] to ends[k] (`ends`: the run's
        start, then each step's end, as the driver's clock adds them up): the scheduler, the
        KV manager and the recorder end where m single steps would leave them."""
        m = len(ends) - 1
        if not m:
            return
        scheduler, kv, bs = self.scheduler, self.scheduler.kv, self.block_size
        seqs, starts, n = self.seqs, self.starts, self.n
        used0, computed0 = kv.num_used_blocks, sum(starts)
        tables0 = [len(seq.block_table) for seq in seqs]
        opened = kv.append_decode_tokens(seqs, starts, m)
        # the sequences after m more tokens each
        end_s = ends[m]
        for seq, c in zip(seqs, starts):
            seq.num_computed_tokens = c + m
            seq.num_tokens += m
            seq.num_output_tokens += m
            seq.last_token_s = end_s
        # every sequence got a token at the end of each step (of step 0 as the run starts)
        durations = [ends[k] - ends[k - 1] for k in range(1, m + 1)]
        itl = scheduler.itl_s
        for d in durations:
            itl.extend(array("d", (d,)) * n)
        scheduler.step_id += m
        # what the recorder's observe would have seen in each step
        used, blocks = used0, sum(tables0)
        used_rows, waste_rows = [], []
        running = scheduler.running
        for k in range(1, m + 1):
            used += opened[k]
            blocks += opened[k]
            used_rows.append(used)
            waste_rows.append(kv.allocated_slots(blocks, running) - (computed0 + n * (k - 1))
                              - n)
        recorder.record_decode_run(self.plan, n, ends, durations, used_rows, waste_rows,
                                   self._table_steps(tables0, m))

    def _table_steps(self, tables0: list, m: int) -> dict:
        """Block-table length -> sequence-steps spent at it over steps 1..m (a table grows by a
        block in each step whose token opens one, and the step sees the longer table)."""
        bs = self.block_size
        counts: dict = {}
        for c, nb in zip(self.starts, tables0):
            k, opens = 1, (-c) % bs + 1
            while k <= m:
                if k == opens:
                    nb += 1
                    opens += bs
                last = min(m, opens - 1)
                counts[nb] = counts.get(nb, 0) + last - k + 1
                k = last + 1
        return counts


def decode_run(scheduler, plan: StepPlan) -> DecodeRun | None:
    """The run that follows `plan`, just finished (`finish_step` applied), or None when the next
    step may differ from it: the plan did more than decode every running sequence once, a
    sequence finished, something arrived, was cancelled or rejected meanwhile, a table is not
    exactly its computed tokens' blocks or a partial tail block is shared (its next token
    copies it), or the KV manager cannot say (the contiguous one)."""
    if plan.num_prefill_seqs or not plan.scheduled or plan.preempted or plan.cancelled \
            or plan.rejected or plan.forked or plan.block_copies or plan.swap_out \
            or plan.swap_in:
        return None
    if scheduler.num_running_seqs != len(plan.scheduled) \
            or len(scheduler.running) != plan.num_running \
            or len(scheduler.waiting) + len(scheduler.swapped) != plan.num_waiting \
            or scheduler.has_pending_events():
        return None
    kv = scheduler.kv
    appends = getattr(kv, "appends_in_place", None)
    if appends is None or not all(appends(item.seq) for item in plan.scheduled):
        return None
    run = DecodeRun(scheduler, plan)
    return run if run.max_steps > 0 else None
