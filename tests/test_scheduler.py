"""The iteration-level scheduler, behaviour by behaviour (issue 4), driven step by step.

Every step: `schedule(now)`, then `finish_step(plan, None, now + 1)`, as the simulator does; block
size 16 throughout. `scheduled(plan)` lists (request id, tokens) in plan order.
"""
import pytest

from simkv.engine.kv.contiguous import ContiguousKVCacheManager
from simkv.engine.kv.paged import PagedKVCacheManager
from simkv.engine.request import Request, RequestStatus
from simkv.engine.scheduler import Scheduler

BS = 16


def make_scheduler(num_blocks=1000, *, host_blocks=0, prefix_caching=True, watermark=0.0,
                   **knobs):
    kv = PagedKVCacheManager(num_blocks, BS, enable_prefix_caching=prefix_caching,
                             watermark=watermark, num_host_blocks=host_blocks)
    knobs.setdefault("max_model_len", 4096)
    return Scheduler(kv, **knobs)


def make_request(rid, prompt, output=10, *, ids=None, **fields):
    return Request(rid, 0.0, prompt, output, prefix_ids=tuple(ids) if ids else None,
                   prefix_block_tokens=BS if ids else 0, **fields)


def step(sched):
    now = float(sched.step_id)
    plan = sched.schedule(now)
    sched.finish_step(plan, None, now + 1.0)
    sched.kv.check_integrity()
    return plan


def scheduled(plan):
    return [(item.seq.request.request_id, item.num_tokens) for item in plan.scheduled]


def run_to_completion(sched, max_steps=5000):
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        plan = step(sched)
        assert not plan.is_empty or plan.cancelled or plan.rejected or plan.preempted
    raise AssertionError("requests still unfinished")


def assert_nothing_held(sched):
    kv = sched.kv
    assert not sched.requests and not sched.waiting and not sched.running and not sched.swapped
    assert sched.num_running_seqs == 0 and kv.seqs == {}
    assert kv.num_free_blocks == kv.num_blocks and not any(kv.pool.ref_cnt)
    assert len(kv.host.free) == kv.host.num_blocks and not any(kv.host.ref_cnt)
    kv.check_integrity()


# --- chunked prefill and the token budget ----------------------------------------------------

def test_budget_1024_threshold_400_chunks_three_800_token_prompts_400_400_224():
    sched = make_scheduler(max_num_batched_tokens=1024, long_prefill_token_threshold=400)
    for rid in range(3):
        sched.add_request(make_request(rid, 800))
    first, second, third = step(sched), step(sched), step(sched)
    assert scheduled(first) == [(0, 400), (1, 400), (2, 224)]
    assert scheduled(second) == [(0, 400), (1, 400), (2, 224)]
    assert scheduled(third) == [(0, 1), (1, 1), (2, 352)]
    assert [item.is_decode for item in third.scheduled] == [True, True, False]
    assert (third.num_decode_tokens, third.num_prefill_tokens) == (2, 352)


def test_with_chunking_off_short_prompts_do_not_jump_a_long_one():
    sched = make_scheduler(max_num_batched_tokens=512, enable_chunked_prefill=False,
                           max_model_len=512)
    sched.add_request(make_request(0, 100, 5))
    sched.add_request(make_request(1, 500, 5))    # needs 500 > 412 tokens left: waits
    sched.add_request(make_request(2, 10, 5))     # would fit, but not ahead of request 1
    assert scheduled(step(sched)) == [(0, 100)]
    assert scheduled(step(sched)) == [(0, 1), (1, 500), (2, 10)]


def test_with_chunking_on_a_long_prompt_takes_what_is_left_of_the_budget():
    sched = make_scheduler(max_num_batched_tokens=512)
    sched.add_request(make_request(0, 100, 5))
    sched.add_request(make_request(1, 500, 5))
    sched.add_request(make_request(2, 10, 5))
    assert scheduled(step(sched)) == [(0, 100), (1, 412)]


def test_cached_tokens_are_free_so_two_prompts_sharing_a_prefix_fit_the_budget_together():
    sched = make_scheduler(max_num_batched_tokens=112)
    a = make_request(0, 96, ids=[0, 1, 2, 3, 4, 5])
    b = make_request(1, 96, ids=[0, 1, 2, 3, 4, 5])
    sched.add_request(a)
    sched.add_request(b)
    plan = step(sched)
    # b hits the 5 full blocks a allocated in this same step: 96 + 16 = 112 tokens
    assert scheduled(plan) == [(0, 96), (1, 16)]
    assert (a.cached_tokens, b.cached_tokens) == (0, 80)
    assert a.status == b.status == RequestStatus.RUNNING
    assert sched.kv.num_used_blocks == 7           # 6 for a, 1 of b's own


def test_running_requests_are_served_before_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(make_request(0, 64, 5))
    step(sched)
    sched.add_request(make_request(1, 200, 5))
    assert scheduled(step(sched)) == [(0, 1), (1, 63)]


def test_max_num_seqs_caps_the_running_batch():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=1000)
    for rid in range(3):
        sched.add_request(make_request(rid, 10, 5))
    assert scheduled(step(sched)) == [(0, 10), (1, 10)]
    assert [r.request_id for r in sched.waiting] == [2]


# --- preemption ------------------------------------------------------------------------------

def two_80_token_requests(**knobs):
    """11 blocks of 16; two 80-token prompts take 5 blocks each, then each decode needs a 6th."""
    sched = make_scheduler(11, max_num_batched_tokens=1024, **knobs)
    first, later = make_request(0, 80, 10), make_request(1, 80, 10)
    sched.add_request(first)
    sched.add_request(later)
    assert scheduled(step(sched)) == [(0, 80), (1, 80)]
    assert sched.kv.num_free_blocks == 1
    return sched, first, later


def test_11_blocks_two_80_token_prompts_the_later_one_is_preempted_for_a_6th_block():
    sched, first, later = two_80_token_requests()
    plan = step(sched)
    assert plan.preempted == [1] and scheduled(plan) == [(0, 1)]
    assert len(first.seqs[0].block_table) == 6      # the first got the 11th block
    assert later.status == RequestStatus.WAITING and sched.waiting[0] is later
    assert later.seqs[0].block_table == [] and later.seqs[0].num_computed_tokens == 0
    assert later.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.kv.num_used_blocks == 6


def test_a_recomputed_request_hits_its_own_blocks_in_the_prefix_cache():
    sched, first, later = two_80_token_requests()
    run_to_completion(sched)
    assert later.status == RequestStatus.COMPLETED
    assert later.cached_tokens == 80 and later.recomputed_tokens == 0


def test_without_prefix_caching_a_recomputed_request_computes_everything_again():
    sched, first, later = two_80_token_requests(prefix_caching=False)
    run_to_completion(sched)
    assert later.cached_tokens == 0 and later.recomputed_tokens == 80


def test_no_admission_or_swap_in_in_a_step_that_preempted():
    sched, first, later = two_80_token_requests(preemption_mode="swap", host_blocks=16)
    small = make_request(2, 4, 5)
    sched.add_request(small)                       # 1 block would do, and 5 are free
    plan = step(sched)
    assert plan.preempted == [1] and later.status == RequestStatus.SWAPPED
    assert scheduled(plan) == [(0, 1)] and plan.swap_in == []
    assert small.status == RequestStatus.WAITING


def test_swap_preemption_moves_the_blocks_to_host_and_resumes_them_first():
    sched, first, later = two_80_token_requests(preemption_mode="swap", host_blocks=16)
    blocks = list(later.seqs[0].block_table)
    plan = step(sched)
    assert sorted(d for d, _ in plan.swap_out) == sorted(blocks)
    assert later.seqs[0].host_table == [h for _, h in plan.swap_out]
    sched.add_request(make_request(2, 4, 5))
    plan = step(sched)                             # 5 blocks free: the swapped one comes back
    assert len(plan.swap_in) == 5 and later.status == RequestStatus.RUNNING
    assert [r.request_id for r in sched.waiting] == [2]
    run_to_completion(sched)
    assert_nothing_held(sched)


def test_swap_mode_falls_back_to_recompute_when_the_host_pool_is_full():
    sched, first, later = two_80_token_requests(preemption_mode="swap", host_blocks=4)
    plan = step(sched)                             # 5 blocks do not fit in 4 host blocks
    assert plan.preempted == [1] and plan.swap_out == []
    assert later.status == RequestStatus.WAITING and sched.num_swap_fallbacks == 1
    assert len(sched.kv.host.free) == 4


def test_priority_policy_preempts_the_least_important_even_if_already_scheduled():
    sched = make_scheduler(11, max_num_batched_tokens=1024, preemption_policy="priority")
    low, high = make_request(0, 80, 10, priority=1), make_request(1, 80, 10, priority=0)
    sched.add_request(low)
    sched.add_request(high)
    step(sched)
    plan = step(sched)
    assert plan.preempted == [0] and scheduled(plan) == [(1, 1)]
    assert low.status == RequestStatus.WAITING and high.status == RequestStatus.RUNNING
    assert plan.num_decode_tokens == 1             # the low one's decode left the plan


def test_a_request_preempted_in_the_step_that_scheduled_it_leaves_no_uncomputed_hit():
    # V prefills 32 tokens a step; in step 3 it is given blocks for tokens 64..95, then H's
    # decode needs a block and the priority policy preempts V: tokens 64..95 are never
    # computed, so V's re-admission may hit only its first 64 tokens.
    sched = make_scheduler(7, max_num_batched_tokens=48, long_prefill_token_threshold=32,
                           preemption_policy="priority")
    v, h = make_request(0, 96, 10, priority=1), make_request(1, 15, 10, priority=0)
    sched.add_request(v)
    sched.add_request(h)
    assert scheduled(step(sched)) == [(0, 32), (1, 15)]
    assert scheduled(step(sched)) == [(0, 32), (1, 1)]
    plan = step(sched)
    assert plan.preempted == [0] and scheduled(plan) == [(1, 1)]
    assert sched.kv.prefix_lookup(v.seqs[0])[1] == 64
    run_to_completion(sched)
    assert v.cached_tokens == 64 and v.recomputed_tokens == 0
    assert_nothing_held(sched)


# --- parallel sampling -----------------------------------------------------------------------

def test_n_3_prefills_once_then_forks_three_samples_sharing_the_prompt():
    sched = make_scheduler()
    req = make_request(0, 40, 5, n=3)
    sched.add_request(req)
    plan = step(sched)
    assert scheduled(plan) == [(0, 40)] and len(plan.forked) == 2
    assert len(req.seqs) == 3 and sched.num_running_seqs == 3
    assert len({tuple(s.block_table) for s in req.seqs}) == 1 and sched.kv.num_used_blocks == 3
    plan = step(sched)
    assert scheduled(plan) == [(0, 1)] * 3
    assert len(plan.block_copies) == 2            # the shared 8-token tail, for 2 of 3 samples


def test_an_n_gt_1_request_finishes_when_its_last_sample_finishes():
    # A budget of one token a step: sample 0 decodes first every step, sample 1 waits for it.
    sched = make_scheduler(max_num_batched_tokens=1)
    req = make_request(0, 4, 3, n=2)
    sched.add_request(req)
    for _ in range(4):                             # prefill, one token a step, then the fork
        step(sched)
    first, second = req.seqs
    step(sched)
    step(sched)
    assert first.finished and req.seqs == [second] and second.num_output_tokens == 1
    assert req.status == RequestStatus.RUNNING and sched.num_running_seqs == 1
    step(sched)
    step(sched)
    assert req.status == RequestStatus.COMPLETED and req.finish_s == 8.0
    assert_nothing_held(sched)


def forked_request_under_pressure():
    """8 blocks, no prefix caching: A (16 + 40 tokens) grows until it preempts R (n = 2, 40 + 30
    tokens, 8 blocks at most with the prompt shared) in step 18, after 17 tokens per sample."""
    sched = make_scheduler(8, prefix_caching=False, max_num_batched_tokens=256,
                           max_model_len=256)
    a, r = make_request(0, 16, 40), make_request(1, 40, 30, n=2)
    sched.add_request(a)
    sched.add_request(r)
    for _ in range(17):
        step(sched)
    assert step(sched).preempted == [1]
    assert [(s.num_computed_tokens, s.num_tokens) for s in r.seqs] == [(0, 57), (0, 57)]
    return sched, a, r


def test_a_recomputed_forked_request_prefills_the_prompt_once_and_re_forks():
    sched, a, r = forked_request_under_pressure()
    first, second = r.seqs
    plan = step(sched)
    assert scheduled(plan) == [(0, 1), (1, 57)]    # the first sample only: prompt + 17 outputs
    assert plan.forked == [(first.seq_id, second.seq_id)]
    assert second.num_computed_tokens == 40 and second.block_table == first.block_table[:3]
    # 4 blocks for the first sample, 3 for A; the second sample holds none of its own yet
    assert sched.kv.num_used_blocks == 7 and len(a.seqs[0].block_table) == 3


def test_a_recomputed_forked_request_completes_on_a_pool_that_holds_one_prompt_copy():
    # Recomputing both samples from scratch needs 2 x 4 blocks next to A's: the request was
    # never admitted again and the simulator stopped ("requests wait but nothing can run").
    sched, a, r = forked_request_under_pressure()
    run_to_completion(sched)
    assert a.status == r.status == RequestStatus.COMPLETED
    assert [s.num_output_tokens for s in r.all_seqs] == [30, 30]
    assert_nothing_held(sched)


# --- cancellation and rejection --------------------------------------------------------------

def drive_to(state):
    """A scheduler with request 1 in `state`; request 0 keeps it company where needed."""
    if state == "swapped":
        sched, _, target = two_80_token_requests(preemption_mode="swap", host_blocks=16)
        step(sched)
    else:
        sched = make_scheduler(max_num_batched_tokens=16)
        target = make_request(1, 64, 10, n=2)
        sched.add_request(target)
        steps = {"waiting": 0, "mid-prefill": 1, "decoding": 5}[state]
        for _ in range(steps):
            step(sched)
    assert target.status == {"waiting": RequestStatus.WAITING, "swapped": RequestStatus.SWAPPED
                             }.get(state, RequestStatus.RUNNING)
    return sched, target


@pytest.mark.parametrize("state", ["waiting", "mid-prefill", "decoding", "swapped"])
def test_cancel_frees_everything_in_every_state(state):
    sched, target = drive_to(state)
    if state == "decoding":
        assert len(target.seqs) == 2 and target.seqs[1].num_output_tokens == 2
    sched.cancel(1)
    plan = step(sched)
    assert plan.cancelled == [1] and target.status == RequestStatus.CANCELLED
    assert all(s.block_table == [] and s.host_table is None for s in target.seqs)
    assert 1 not in sched.requests and target in sched.done
    run_to_completion(sched)
    assert_nothing_held(sched)


def test_cancelling_a_finished_or_unknown_request_is_a_no_op():
    sched = make_scheduler()
    sched.add_request(make_request(0, 10, 1))
    step(sched)
    sched.cancel(0)
    sched.cancel(99)
    assert step(sched).cancelled == []
    assert_nothing_held(sched)


@pytest.mark.parametrize("knobs, request_fields, reason", [
    ({"max_model_len": 100}, {"prompt": 90, "output": 20}, "max_model_len"),
    ({"num_blocks": 4}, {"prompt": 60, "output": 10}, "KV blocks"),
    ({"num_blocks": 8}, {"prompt": 40, "output": 30, "n": 3}, "KV blocks"),
    ({"max_num_seqs": 2}, {"prompt": 10, "output": 5, "n": 3}, "max_num_seqs"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64},
     {"prompt": 100, "output": 5}, "chunked prefill off"),
])
def test_a_request_that_can_never_be_served_is_rejected_with_a_reason(knobs, request_fields,
                                                                      reason):
    sched = make_scheduler(**knobs)
    req = make_request(0, request_fields["prompt"], request_fields["output"],
                       n=request_fields.get("n", 1))
    sched.add_request(req)
    assert req.status == RequestStatus.REJECTED and reason in req.reason
    plan = step(sched)
    assert plan.rejected == [0] and plan.scheduled == [] and sched.done == [req]
    assert not sched.has_unfinished()


def test_the_largest_servable_request_is_not_rejected():
    sched = make_scheduler(6, max_model_len=96)   # 96 tokens = 6 blocks exactly
    req = make_request(0, 90, 7)
    sched.add_request(req)
    run_to_completion(sched)
    assert req.status == RequestStatus.COMPLETED


# --- nothing remains -------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_after_all_requests_finish_no_state_remains(mode):
    sched = make_scheduler(24, host_blocks=12, preemption_mode=mode, max_num_batched_tokens=64,
                           max_model_len=256)
    for rid in range(12):
        sched.add_request(make_request(rid, 20 + 9 * rid, 5 + rid, n=1 + rid % 3,
                                       ids=[0, 1, 2] if rid % 2 else None))
    run_to_completion(sched)
    assert all(r.status == RequestStatus.COMPLETED for r in sched.done) and len(sched.done) == 12
    assert sched.num_preemptions > 0
    assert_nothing_held(sched)


def test_the_contiguous_allocator_runs_under_the_same_scheduler():
    kv = ContiguousKVCacheManager(num_blocks=16, block_size=BS, max_model_len=64,
                                  num_host_blocks=8)
    sched = Scheduler(kv, max_model_len=64, max_num_batched_tokens=64, preemption_mode="swap")
    for rid in range(6):
        sched.add_request(make_request(rid, 10 + 5 * rid, 8, n=1 + rid % 2))
    run_to_completion(sched)
    assert all(r.status == RequestStatus.COMPLETED for r in sched.done)
    assert kv.num_used_blocks == 0 and kv.free_ranges == [(0, 16)] and kv.unforked == {}
    assert len(kv.host.free) == 8


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forks_never_push_the_running_sequences_past_max_num_seqs(mode):
    # A request with n = 3 holds 3 seats from admission on (it forks once its chunked prompt is
    # done): single-sample requests admitted meanwhile must not push the batch past the limit.
    # A tight pool adds preemptions (re-admission and swap-in count the same seats).
    sched = make_scheduler(12, host_blocks=200, max_num_seqs=4, max_num_batched_tokens=24,
                           preemption_mode=mode)
    for rid in range(12):
        sched.add_request(make_request(rid, 40 if rid % 4 == 0 else 3, 30, n=3 if rid % 4 == 0 else 1))
    most = 0
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        plan = step(sched)
        live = sum(len(req.seqs) for req in sched.running)
        assert live <= 4 and len(plan.scheduled) <= 4
        most = max(most, live)
    assert not sched.has_unfinished() and most == 4
    assert sched.num_preemptions > 0
    assert_nothing_held(sched)
