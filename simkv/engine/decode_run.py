"""Decode runs: steps in a row that decode the same batch, taken together.

A plan that decodes every running sequence and does nothing else (no prefill chunk, admission,
preemption, copy or swap) is followed by the same plan one token further on, for as long as
nothing changes the batch: until an arrival or a cancellation (the driver's horizon), a
sequence's last token, or the pool running out of free blocks. Such a run's steps are known
before they are taken: sequence i of the batch computes token c_i + k - 1 in step k (c_i: its
computed tokens as step 1, the plan just scheduled, starts), takes a block where that token
opens one and registers a block where it fills one (the KV manager's `append_decode_tokens`,
as the steps' `allocate_slots(seq, 1)` would). The serving loop (simkv.engine.loop) asks for a
run after each `schedule`; the executor times its steps (a cost model can do so in closed
form), and `commit` applies them to the scheduler, the KV manager and the recorder: the same
state, rows and floats as taking the steps one by one (tests/test_decode_run.py). The last step
may finish sequences; the scheduler's own `finish_step` applies it.

Why the batch does not change inside a run: what step 1 left waiting stays waiting. The head of
the queue was refused a seat, the token budget or blocks, and none of those comes back inside a
run (seats and budget are constant, free blocks only fall, a decode never fills a block another
request's prompt could hit); swapped requests likewise. The one prompt that can hit a decode's
blocks is a later turn's (simkv.engine.kv.hashing: it holds an earlier request's output), so no
run is taken while a waiting request continues a turn that is not final: as the turn's output
blocks fill, the waiting one's hits grow and it may fit
(tests/test_multiturn.py::test_no_decode_run_while_a_later_turn_waits_on_a_live_one).

Fleets: a run is planned to a horizon the driver gives (the next event that can reach this
replica: under a router that reads replica state, the fleet's next arrival) and committed once
its time has passed; what a router reads of a replica inside a run is what the steps one by one
would show (simkv.sim.cluster.fleet). Cutting a run where an arrival is routed to the replica
(so that runs could outlast the fleet's arrivals) would need the steps' times and clock states
kept per step: not written.
"""
from __future__ import annotations

from array import array
from itertools import accumulate
from operator import sub

from simkv.engine.kv.paged import first_opening_step
from simkv.engine.plan import ScheduledSeq, StepPlan

MAX_RUN_STEPS = 4096       # steps one run covers at most (it is planned before it is timed)
MIN_RUN_STEPS = 3          # a shorter run costs more to plan than its steps one by one


class DecodeRun:
    """Steps 1..m, step 1 being `plan` (scheduled, not yet executed), each decoding every
    sequence of the batch once.

    `seqs` (plan order), `starts` (c_i: the token each computes in step 1), `n`,
    `context_tokens` (step 1's decode context, summed; step k adds n x (k - 1)), `max_steps`
    (up to the step of the first sequence's last token, cut where the pool's free blocks run
    out)."""

    def __init__(self, scheduler, plan: StepPlan, seqs: list, starts: list, to_go: int):
        """`seqs` and `starts` of the plan's items; `to_go`: the fewest output tokens a
        sequence has left."""
        self.scheduler, self.plan = scheduler, plan
        self.seqs, self.starts = seqs, starts
        self.n = len(seqs)
        self.context_tokens = plan.decode_context_tokens
        self.block_size = bs = scheduler.kv.block_size
        # the first step from 2 on whose token opens a block, per sequence
        self.first_openings = [first_opening_step(c, bs, 2) for c in starts]
        self.max_steps = self._max_steps(to_go)

    # -- bounds -------------------------------------------------------------------------------
    def _max_steps(self, to_go: int) -> int:
        """Steps up to a sequence's last token, cut where the pool's free blocks run out."""
        steps = min(MAX_RUN_STEPS, to_go)
        free = self.scheduler.kv.num_free_blocks
        if self.blocks_taken(steps) <= free:
            return steps
        low, high = 1, steps            # blocks_taken(low) <= free < blocks_taken(high)
        while high - low > 1:
            mid = (low + high) // 2
            if self.blocks_taken(mid) <= free:
                low = mid
            else:
                high = mid
        return low

    def blocks_taken(self, steps: int) -> int:
        """Blocks the batch takes in steps 2..`steps` (step 1's are taken): one where a token
        opens a block."""
        bs = self.block_size
        return sum((steps - k) // bs + 1 for k in self.first_openings if k <= steps)

    # -- the steps, as plans ------------------------------------------------------------------
    def plan_at(self, k: int, now_s: float) -> StepPlan:
        """Step k of the run as the scheduler would plan it, with its state snapshot."""
        if k == 1:
            return self.plan
        first = self.plan
        plan = StepPlan(first.step + k - 1, now_s,
                        [ScheduledSeq(seq, c + k - 1, 1, True)
                         for seq, c in zip(self.seqs, self.starts)])
        plan.count_tokens()
        plan.num_running, plan.num_waiting = first.num_running, first.num_waiting
        taken = self.blocks_taken(k)
        plan.kv_blocks_used = first.kv_blocks_used + taken
        plan.kv_blocks_free = first.kv_blocks_free - taken
        return plan

    # -- applying it --------------------------------------------------------------------------
    def commit(self, ends: list, recorder) -> None:
        """Apply steps 1..m, step k running from ends[k - 1] to ends[k] (`ends`: the run's
        start, then each step's end, as the driver's clock adds them up): the scheduler, the
        KV manager and the recorder end where m single steps would leave them."""
        m = len(ends) - 1
        scheduler, kv = self.scheduler, self.scheduler.kv
        seqs, starts, n = self.seqs, self.starts, self.n
        tables = [len(seq.block_table) for seq in seqs]       # as step 1 runs
        opened = kv.append_decode_tokens(seqs, starts, m, 2)[1:]    # in steps 1..m
        durations = list(map(sub, ends[1:], ends[:-1]))        # ends[k] - ends[k - 1]
        # what the recorder's observe would have seen in each step: the blocks in use, and
        # the slots the tables hold that no computed token or this step's fills
        plan = self.plan
        used_rows = list(accumulate(opened, initial=plan.kv_blocks_used))[1:]
        table_rows = list(accumulate(opened, initial=sum(tables)))[1:]
        allocated_slots, running = kv.allocated_slots, scheduler.running
        computed = sum(starts)
        waste_rows = [allocated_slots(blocks, running) - filled for blocks, filled
                      in zip(table_rows, range(computed + n, computed + n * m + 1, n))]
        recorder.record_decode_run(plan, n, ends, durations, used_rows, waste_rows,
                                   self._table_steps(tables, m))
        # steps 1..m-1: every sequence gets a token at each step's end, none its last
        if m > 1:
            itl = scheduler.itl_s
            itl.extend(array("d", [ends[1] - seq.last_token_s for seq in seqs]))
            for d in durations[1:m - 1]:
                itl.extend(array("d", (d,)) * n)
            done, last_token_s = m - 1, ends[m - 1]
            for seq in seqs:
                seq.num_computed_tokens += done
                seq.num_tokens += done
                seq.num_output_tokens += done
                seq.last_token_s = last_token_s
        scheduler.step_id += m - 1
        # step m as the scheduler finishes any step (it may finish sequences); finish_step
        # reads the plan's items' sequences and token counts only, which are step 1's
        scheduler.finish_step(plan, None, ends[m])

    def _table_steps(self, tables: list, m: int) -> dict:
        """Block-table length -> sequence-steps spent at it over steps 1..m (a table grows by a
        block in each step from 2 on whose token opens one, and the step sees the longer
        table)."""
        bs = self.block_size
        counts: dict = {}
        for first, nb in zip(self.first_openings, tables):
            k = 1                        # steps k..opens-1 at nb blocks, then one more
            for opens in range(first, m + 1, bs):
                counts[nb] = counts.get(nb, 0) + opens - k
                nb += 1
                k = opens
            counts[nb] = counts.get(nb, 0) + m - k + 1
        return counts


class RunAttempts:
    """When to look over a batch for a decode run: at each plan that only decodes, except after
    looks that found none worth taking (a batch whose sequences finish every few steps), which
    back off: the next look comes 1, 2, 4 ... 64 such plans later, until one finds a run
    again. A look costs a pass over the batch; not looking only takes those steps one by one
    (the same results)."""

    MAX_SKIP = 64

    def __init__(self):
        self.skip = 0             # plans still to take one by one
        self.backoff = 0

    def look(self) -> bool:
        if self.skip:
            self.skip -= 1
            return False
        return True

    def found(self, steps: int) -> None:
        """A look found a run of `steps` steps (0: none)."""
        if steps >= MIN_RUN_STEPS:
            self.backoff = 0
        else:
            self.backoff = min(self.MAX_SKIP, 2 * self.backoff or 1)
            self.skip = self.backoff


def decode_run(scheduler, plan: StepPlan, attempts: RunAttempts | None = None) \
        -> DecodeRun | None:
    """The run that `plan` (just scheduled) starts, or None when the steps after it may differ:
    it does more than decode every running sequence once, a sequence has fewer than
    MIN_RUN_STEPS tokens to go, or a table does not hold exactly the blocks of its tokens so far
    (its partial tail shared, or with prefix caching a full block not registered), or the KV
    manager cannot say (the contiguous one), or a waiting request continues a live one.
    `attempts` paces the looks that pass over the batch (RunAttempts)."""
    if plan.num_prefill_seqs or not plan.scheduled or plan.preempted or plan.cancelled \
            or plan.rejected or plan.block_copies or plan.swap_out or plan.swap_in:
        return None
    if scheduler.num_running_seqs != len(plan.scheduled):
        return None
    appends = getattr(scheduler.kv, "appends_in_place", None)
    if appends is None or (attempts is not None and not attempts.look()):
        return None
    seqs = [item.seq for item in plan.scheduled]
    starts = [item.start for item in plan.scheduled]
    to_go = min([seq.request.output_tokens - seq.num_output_tokens for seq in seqs])
    if to_go < MIN_RUN_STEPS or not all(map(appends, seqs, [c + 1 for c in starts])) \
            or (scheduler.has_turns and _waits_on_a_live_turn(scheduler)):
        if attempts is not None:
            attempts.found(0)
        return None
    return DecodeRun(scheduler, plan, seqs, starts, to_go)


def _waits_on_a_live_turn(scheduler) -> bool:
    """Whether a waiting request continues (through any number of turns) a request that is not
    final: one the scheduler still holds (`requests`: queued, running, swapped)."""
    live = scheduler.requests
    for req in scheduler.waiting:
        turn = req.parent
        while turn is not None:
            if turn.request_id in live:
                return True
            turn = turn.parent
    return False
