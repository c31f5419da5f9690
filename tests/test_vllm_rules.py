"""vLLM v0.26's scheduling rules (semantics vllm-0.26), each re-expressed with small numbers.

Every test names the vLLM v0.26.0 file and function whose behaviour it restates. Steps as in
tests/test_scheduler.py: `schedule(now)`, then `finish_step(plan, None, now + 1)`; block size 16.
"""
import pytest

from simkv import semantics as rules
from simkv.config.scenario import CacheConfig, SchedulerConfig, load_scenario
from simkv.engine.request import Request, RequestStatus
from simkv.sizing import size_pool
from simkv.specs import load_gpu, load_model
from tests.test_config import minimal
from tests.test_scheduler import BS, make_request, make_scheduler, run_to_completion, step


def scheduled(plan):
    return [(item.seq.request.request_id, item.seq.sample, item.num_tokens)
            for item in plan.scheduled]


# --- the full-prompt admission gate ----------------------------------------------------------


def gated_pair(reserve: bool):
    """A pool of 10 blocks; A (96 tokens = 6 blocks) runs; B's prompt of 80 tokens (5 blocks)
    is prefilled 16 tokens a step (long_prefill_token_threshold)."""
    sched = make_scheduler(10, long_prefill_token_threshold=16, reserve_full_prompt=reserve)
    sched.add_request(make_request(0, 96, 50))
    step(sched)                                  # A's 96 prompt tokens... in 16-token chunks
    while sched.running[0].seqs[0].num_computed_tokens < 96:
        step(sched)
    sched.add_request(make_request(1, 80, 5))
    return sched


def test_the_gate_waits_until_the_whole_prompt_fits():
    """vllm/v1/core/sched/scheduler.py, Scheduler.schedule (waiting loop, with
    scheduler_reserve_full_isl): B needs ceil(80/16) = 5 blocks for its whole prompt; 4 are
    free (10 - A's 6, A's next token still in its 6th block... A holds 6 + 1 after token 97),
    so B waits although its first chunk (1 block) would fit."""
    sched = gated_pair(reserve=True)
    plan = step(sched)
    assert sched.kv.num_free_blocks < 5
    assert [r for r, _, _ in scheduled(plan)] == [0]
    assert sched.requests[1].status == RequestStatus.WAITING


def test_without_the_gate_the_first_chunk_is_enough():
    """The older rule (semantics vllm-0.18): B is admitted as soon as its first chunk fits."""
    sched = gated_pair(reserve=False)
    plan = step(sched)
    assert (1, 0, 16) in scheduled(plan)


def test_the_gate_counts_free_cached_hits_as_taken_and_held_hits_as_there():
    """vllm/v1/core/kv_cache_manager.py, KVCacheManager.allocate_slots: hit blocks in the free
    queue leave it when touched, so they are subtracted from the free blocks; a hit held by a
    running request costs nothing. Pool 8: X (64 tokens, ids 1..4) finishes and its 4 blocks
    stay cached in the free queue; Y asks for X's 64 tokens + 32 more (6 blocks): hits 4
    (leaving a token to compute it would hit 4 only if 96 - 1 >= 64: yes), needs 2 more;
    free 8, minus its 4 free hits = 4 >= 2: admitted."""
    sched = make_scheduler(8, reserve_full_prompt=True)
    ids = (1, 2, 3, 4)
    sched.add_request(Request(0, 0.0, 64, 1, prefix_ids=ids, prefix_block_tokens=BS))
    run_to_completion(sched)
    assert sched.kv.num_cached_free_blocks == 4
    sched.add_request(Request(1, 0.0, 96, 2, prefix_ids=ids + (5, 6), prefix_block_tokens=BS))
    plan = step(sched)
    assert scheduled(plan) == [(1, 0, 32)]
    assert sched.done[-1].request_id == 0 and sched.requests[1].cached_tokens == 64


def preempted_pair(reserve: bool):
    """Pool 6, no prefix caching, prefills of 16 tokens a step: A and B (32-token prompts, 40
    outputs) take 2 blocks each, a third at token 32; at token 48 A needs a fourth, preempts B
    (3 blocks back: 3 free, A takes 1: 2 free). B now has 49 tokens to recompute: 4 blocks."""
    sched = make_scheduler(6, prefix_caching=False, long_prefill_token_threshold=16,
                           reserve_full_prompt=reserve)
    sched.add_request(make_request(0, 32, 40))
    sched.add_request(make_request(1, 32, 40))
    while not sched.num_preemptions:
        step(sched)
    (victim,) = sched.waiting
    assert (victim.request_id, victim.seqs[0].num_tokens, sched.kv.num_free_blocks) == (1, 49, 2)
    return sched


def test_the_gate_applies_to_a_recompute_preempted_request_too():
    """A preempted request waits again and is gated like a new one, over everything it had
    (vllm/v1/core/sched/scheduler.py, Scheduler.schedule): B needs 4 blocks and waits while A
    runs (2 free, then 1), then comes back once A is done."""
    sched = preempted_pair(reserve=True)
    while 0 in sched.requests:                   # A runs
        assert sched.requests[1].status == RequestStatus.WAITING
        assert sched.kv.num_free_blocks < 4
        step(sched)
    run_to_completion(sched)
    assert sched.num_preemptions == 1
    assert [r.status for r in sched.done] == [RequestStatus.COMPLETED] * 2


def test_without_the_gate_a_preempted_request_comes_back_on_its_first_chunk():
    sched = preempted_pair(reserve=False)
    plan = step(sched)
    assert (1, 0, 16) in scheduled(plan)


# --- parallel sampling: n child requests -----------------------------------------------------


def test_a_request_with_n_is_served_as_n_children_sharing_the_prompt_by_prefix_cache():
    """vllm/v1/engine/parallel_sampling.py, ParentRequest: n child requests of n = 1. Child 0
    prefills 64 tokens; child 1, admitted in the same step, hits child 0's 3 full blocks
    (leaving the last token to compute: (64 - 1) // 16 = 3 blocks, 48 tokens)."""
    sched = make_scheduler(parallel_sampling="fanout")
    sched.add_request(make_request(0, 64, 4, n=2))
    plan = step(sched)
    assert scheduled(plan) == [(0, 0, 64), (0, 1, 16)]
    run_to_completion(sched)
    (row,) = sched.done
    assert row.status == RequestStatus.COMPLETED and row.output_tokens == 8
    assert row.cached_tokens == 48 and not plan.forked


def test_a_fanned_out_request_may_have_more_samples_than_max_num_seqs():
    """Each child counts against max_num_seqs on its own, so n = 3 with 2 seats is served
    (the fork rule rejects it: it needs 3 seats at once)."""
    sched = make_scheduler(parallel_sampling="fanout", max_num_seqs=2)
    sched.add_request(make_request(0, 32, 3, n=3))
    plan = step(sched)
    assert [(r, s) for r, s, _ in scheduled(plan)] == [(0, 0), (0, 1)]
    run_to_completion(sched)
    assert sched.done[0].status == RequestStatus.COMPLETED
    forked = make_scheduler(parallel_sampling="fork", max_num_seqs=2)
    forked.add_request(make_request(0, 32, 3, n=3))
    assert forked.done[0].status == RequestStatus.REJECTED


def test_the_fanned_out_row_spans_first_token_to_last_finish():
    """One row: TTFT to the first child's first token, E2E to the last child's finish, output
    tokens summed, TPOT the children's mean. Child 0 runs first (1 seat): 2-token prefill at
    step 1 gives its first token at t=2, its 3rd at t=4; child 1 then: first token at t=5,
    last at t=7 (times are step ends)."""
    sched = make_scheduler(parallel_sampling="fanout", max_num_seqs=1)
    sched.add_request(make_request(0, 2, 3, n=2))
    run_to_completion(sched)
    (row,) = sched.done
    assert (row.first_token_s, row.finish_s, row.output_tokens) == (1.0, 6.0, 6)
    assert row.tpot_s == pytest.approx(1.0)


def test_cancelling_a_fanned_out_request_cancels_every_child():
    sched = make_scheduler(parallel_sampling="fanout")
    sched.add_request(make_request(0, 32, 50, n=3))
    step(sched)
    sched.cancel(0)
    step(sched)
    (row,) = sched.done
    assert row.status == RequestStatus.CANCELLED
    assert not sched.running and not sched.waiting and sched.kv.num_used_blocks == 0


# --- limits ----------------------------------------------------------------------------------


def test_a_prompt_that_reaches_max_model_len_is_rejected_and_a_long_output_capped():
    """vllm/v1/engine/input_processor.py (InputProcessor._validate_prompt_len) rejects a
    prompt of >= max_model_len tokens; vllm/v1/core/sched/utils.py (check_stop) ends a
    sequence at max_model_len tokens. max_model_len 100: a 100-token prompt is rejected; 90 +
    20 is served with 10 outputs; 99 + 5 with 1."""
    sched = make_scheduler(max_model_len=100, cap_output_tokens=True)
    for rid, (p, o) in enumerate([(100, 5), (90, 20), (99, 5), (50, 50)]):
        sched.add_request(make_request(rid, p, o))
    run_to_completion(sched)
    rows = {r.request_id: r for r in sched.done}
    assert rows[0].status == RequestStatus.REJECTED and "max_model_len" in rows[0].reason
    assert [rows[i].output_tokens for i in (1, 2, 3)] == [10, 1, 50]
    assert [rows[i].capped_tokens for i in (1, 2, 3)] == [10, 4, 0]
    assert sched.num_capped == 2


def test_the_older_rule_rejects_what_would_run_past_max_model_len():
    sched = make_scheduler(max_model_len=100)
    sched.add_request(make_request(0, 90, 20))
    assert sched.done[0].status == RequestStatus.REJECTED


def test_the_pool_keeps_one_null_block():
    """vllm/v1/core/block_pool.py, BlockPool.__init__ takes block 0 as the null block: of the
    num_gpu_blocks a pool holds (vllm/v1/core/kv_cache_utils.py, get_num_blocks: pool bytes //
    block bytes) one fewer are usable. cache.num_gpu_blocks_override counts usable blocks: 10
    of them are 11 as vLLM counts them."""
    model, gpu = load_model("llama-3.1-8b"), load_gpu("h200")
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    measured = size_pool(model, gpu, CacheConfig(null_block=True), sched)
    assert measured.num_gpu_blocks == measured.kv_pool_bytes // measured.bytes_per_block
    assert measured.num_blocks == measured.num_gpu_blocks - 1
    without = size_pool(model, gpu, CacheConfig(null_block=False), sched)
    assert (without.num_gpu_blocks, without.num_blocks) == (None, measured.num_gpu_blocks)
    forced = size_pool(model, gpu, CacheConfig(num_gpu_blocks_override=10, null_block=True),
                       sched)
    assert (forced.num_gpu_blocks, forced.num_blocks) == (11, 10)


# --- policy priority -------------------------------------------------------------------------


def test_priority_orders_admission_by_priority_then_arrival():
    """vllm/v1/core/sched/request_queue.py, PriorityRequestQueue: lower value first, then
    earlier arrival. One seat: the order of service is 2 (priority 0), 0, 1 (priority 1)."""
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    for rid, prio in [(0, 1), (1, 1), (2, 0)]:
        sched.add_request(Request(rid, float(rid), 16, 2, priority=prio))
    run_to_completion(sched)
    assert [r.request_id for r in sched.done] == [2, 0, 1]


def test_priority_preempts_the_least_important_and_a_self_preemption_ends_the_pass():
    """vllm/v1/core/sched/scheduler.py, Scheduler.schedule: under priority the victim is the
    running request with the largest (priority, arrival); when it is the request being served,
    nothing after it in the running list is served this step. Pool 4 blocks: A (priority 1,
    admitted first) and B (priority 0, admitted a step later, so after A in the running list)
    need a third block for token 32 in the same step: A is served first, cannot grow, and
    preempts the least important, itself; the pass ends, so B is not served in that step."""
    sched = make_scheduler(4, policy="priority")
    sched.add_request(Request(0, 0.0, 31, 10, priority=1))
    step(sched)                                  # A: 31 prompt tokens (2 blocks), token 31
    sched.add_request(Request(1, 0.5, 30, 10, priority=0))
    plan = step(sched)                           # A decodes token 31; B prefills 30 tokens
    assert scheduled(plan) == [(0, 0, 1), (1, 0, 30)]
    plan = step(sched)                           # A's token 32 needs a third block: none free
    assert plan.preempted == [0] and scheduled(plan) == []
    plan = step(sched)
    assert scheduled(plan) == [(1, 0, 1)]


def test_the_older_priority_victims_keep_serving_after_a_self_preemption():
    """preemption_policy: priority (semantics vllm-0.18's) picks the same victim but goes on
    with the next running request in the same step."""
    sched = make_scheduler(4, preemption_policy="priority")
    sched.add_request(Request(0, 0.0, 31, 10, priority=1))
    step(sched)
    sched.add_request(Request(1, 0.5, 30, 10, priority=0))
    step(sched)
    plan = step(sched)
    assert plan.preempted == [0] and scheduled(plan) == [(1, 0, 1)]


# --- max_loras -------------------------------------------------------------------------------


def test_max_loras_skips_requests_of_a_further_adapter_in_a_step():
    """vllm/v1/core/sched/scheduler.py, Scheduler.schedule: a waiting request whose adapter
    would make more than max_loras distinct adapters in the step is skipped (it keeps its
    place) and the next one is looked at. max_loras 1: a, b, a, base -> a, a and base admitted
    in step 1, b in the step after a's finish."""
    sched = make_scheduler(max_loras=1)
    for rid, adapter in enumerate(["a", "b", "a", ""]):
        sched.add_request(make_request(rid, 16, 2, adapter=adapter))
    plan = step(sched)
    assert [r for r, _, _ in scheduled(plan)] == [0, 2, 3]
    assert sched.waiting[0].request_id == 1
    run_to_completion(sched)
    assert {r.request_id for r in sched.done} == {0, 1, 2, 3}


# --- the semantics key -----------------------------------------------------------------------


def test_each_semantics_fills_the_rules_left_null_and_a_set_rule_wins():
    new = load_scenario(minimal())
    old = load_scenario(minimal(semantics="vllm-0.18"))
    assert (new.scheduler.reserve_full_prompt, new.scheduler.parallel_sampling,
            new.cache.null_block) == (True, "fanout", True)
    assert (old.scheduler.reserve_full_prompt, old.scheduler.parallel_sampling,
            old.cache.null_block, old.scheduler.max_num_seqs) == (False, "fork", False, 256)
    mixed = load_scenario(minimal(semantics="vllm-0.18",
                                  scheduler={"parallel_sampling": "fanout"}))
    assert (mixed.scheduler.parallel_sampling, mixed.scheduler.reserve_full_prompt) == \
        ("fanout", False)


def test_vllm_default_limits_depend_on_the_gpu():
    """vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults (an API server)."""
    assert rules.default_limits("vllm-0.26", load_gpu("h200")) == (1024, 8192)
    assert rules.default_limits("vllm-0.18", load_gpu("h200")) == (256, 8192)


def test_an_unknown_semantics_is_one_line_naming_the_key():
    from simkv.errors import InputError
    with pytest.raises(InputError, match="semantics: 'vllm-0.3' is not one of"):
        load_scenario(minimal(semantics="vllm-0.3"))


def test_vllm_sizes_its_pool_without_the_graphs_and_the_allocators_reserve():
    """vllm/v1/worker/gpu_worker.py, Worker.determine_available_memory: the pool is the budget
    less the weights, torch's peak allocation and the memory outside torch; CUDA graphs are
    captured afterwards, outside the budget, and the caching allocator's reserve is not
    counted. cache.pool_sizing: vllm (semantics vllm-0.26) against engine (vllm-0.18, simkv's
    engine's ledger): the pool grows by exactly those two parts."""
    from simkv.sizing import OUTSIDE_VLLM_BUDGET
    model, gpu = load_model("llama-3.1-8b"), load_gpu("h200")
    sched = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    vllm = size_pool(model, gpu, CacheConfig(pool_sizing="vllm", null_block=True), sched)
    engine = size_pool(model, gpu, CacheConfig(pool_sizing="engine", null_block=True), sched)
    moved = sum(engine.ledger[k] for k in OUTSIDE_VLLM_BUDGET)
    assert moved > 0
    assert vllm.kv_pool_bytes - engine.kv_pool_bytes == moved
    assert vllm.other_bytes == engine.other_bytes - moved
    assert sum(v for k, v in vllm.ledger.items() if k != "device_memory_bytes") \
        == gpu.memory_bytes
