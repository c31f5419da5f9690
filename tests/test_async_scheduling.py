"""`scheduler.async_scheduling`: vLLM v0.26's asynchronous scheduling, two batches in flight.

vLLM schedules step k+1 right after it launches step k and only then waits for step k's output
(vllm/v1/engine/core.py, EngineCore.step_with_batch_queue); the schedule counts step k's tokens
as computed and gives each request that samples a placeholder for its token, so that step k+1
decodes it (vllm/v1/core/sched/async_scheduler.py, AsyncScheduler). So a request arriving during
step k is first scheduled in k+2, and one finishing in step k holds its seat and blocks for the
schedule of k+1; token times are those of the steps that compute them.

The small cases run the serving loop on a clock where every step takes 1 s.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from simkv.engine.kv.paged import PagedKVCacheManager
from simkv.engine.loop import IDLE, NOW, serve
from simkv.engine.metrics import MetricsRecorder
from simkv.engine.request import Request, RequestStatus
from simkv.engine.scheduler import Scheduler
from simkv.errors import InputError
from tests.test_config import minimal

REPO = Path(__file__).resolve().parents[1]
BS = 16


class Recorded:
    """An executor whose every step takes 1 s; it keeps what each executed plan computes and
    the scheduler's state as it was scheduled (`drive` fills in the steps' start times)."""

    def __init__(self):
        self.steps = []          # (start_s, [(request_id, num_tokens)], num_running, blocks used)

    def execute(self, plan):
        items = [(item.seq.request.request_id, item.num_tokens) for item in plan.scheduled]
        self.steps.append((math.nan, items, plan.num_running, plan.kv_blocks_used))
        return 1.0, None

    def step_done(self, plan):
        pass


def scheduler(num_blocks=64, **knobs):
    knobs.setdefault("max_model_len", 1024)
    knobs.setdefault("parallel_sampling", "fanout")
    return Scheduler(PagedKVCacheManager(num_blocks, BS, enable_prefix_caching=False), **knobs)


def drive(sched, arrivals, *, async_scheduling, on_step=None):
    """Serve `arrivals` ([(arrival_s, Request)]) to the end; a request arriving during a step
    is added as the step ends, as the simulator's clock does. Returns the executor's steps."""
    ex = Recorded()
    pending = sorted(arrivals, key=lambda a: a[0])

    def admit(now):
        while pending and pending[0][0] <= now:
            _, req = pending.pop(0)
            sched.add_request(req, req.arrival_s)

    recorder = MetricsRecorder(sched.kv.num_blocks, BS)
    loop = serve(sched, ex, recorder, check_integrity=True, on_step=on_step,
                 async_scheduling=async_scheduling)
    command, now = next(loop), 0.0
    admit(now)
    while True:
        if command is IDLE:
            if not pending:
                loop.close()
                starts = recorder.steps_frame()["start_s"].tolist()
                return [(start, *rest) for start, (_, *rest) in zip(starts, ex.steps)]
            now = pending[0][0]
            admit(now)
        elif command is not NOW:
            now += command
            admit(now)
        command = loop.send(now)


def first_step_of(steps, request_id):
    """1-based index of the first executed step that computes for `request_id`."""
    return next(k for k, (_, items, _, _) in enumerate(steps, 1)
                if any(rid == request_id for rid, _ in items))


@pytest.mark.parametrize("async_scheduling, first", [(False, 3), (True, 4)])
def test_an_arrival_during_a_step_is_first_scheduled_two_steps_later(async_scheduling, first):
    # A decodes in steps 2, 3, ...; B arrives at 1.5, during step 2 (1 s to 2 s). Step 3 was
    # scheduled as step 2 started, at 1 s, before B was there: B's prefill is step 4 (sync: 3)
    a, b = Request(0, 0.0, 16, 10), Request(1, 1.5, 16, 4)
    steps = drive(scheduler(), [(0.0, a), (1.5, b)], async_scheduling=async_scheduling)
    assert first_step_of(steps, 1) == first
    assert steps[first - 1][1] == [(0, 1), (1, 16)]
    assert b.first_token_s == first          # the end of B's prefill step


@pytest.mark.parametrize("async_scheduling, first", [(False, 3), (True, 4)])
def test_a_finishing_request_gives_its_seat_back_one_schedule_later(async_scheduling, first):
    # Two seats: A (2 tokens) and C (10) take them; B waits. A's last token is step 2's, so
    # the schedule of step 3, made as step 2 starts, still sees A seated: B comes in step 4
    a, c, b = Request(0, 0.0, 16, 2), Request(1, 0.0, 16, 10), Request(2, 0.0, 16, 2)
    steps = drive(scheduler(max_num_seqs=2), [(0.0, a), (0.0, c), (0.0, b)],
                  async_scheduling=async_scheduling)
    assert first_step_of(steps, 2) == first
    # step 3 computes C's decode only, not A's (its outputs are all produced) ...
    assert steps[2][1] == ([(1, 1), (2, 16)] if not async_scheduling else [(1, 1)])
    # ... and was scheduled with A still running and holding its 2 blocks (17 tokens) next
    # to C's 2: 4 blocks, against C's 2 alone once A is finished
    assert steps[2][2:] == ((2, 3) if not async_scheduling else (2, 4))
    assert a.finish_s == 2.0                 # A's last token is at the end of step 2 either way


def test_a_finishing_request_gives_its_blocks_back_one_schedule_later():
    # 6 blocks, chunked prefill off. A (32 + 2 tokens) takes 2 blocks, then a 3rd for its last
    # token (step 2); C (16 + 40) takes 1, then 2. B's 64-token prompt needs 4 blocks: 1 is
    # free until A's 3 come back. Sync: as step 2 ends, so B prefills in step 3; async: the
    # schedule of step 3 was made as step 2 started, so B prefills in step 4
    def run(async_scheduling):
        a, c, b = Request(0, 0.0, 32, 2), Request(1, 0.0, 16, 40), Request(2, 0.0, 64, 2)
        return drive(scheduler(num_blocks=6, enable_chunked_prefill=False),
                     [(0.0, a), (0.0, c), (0.0, b)], async_scheduling=async_scheduling)
    sync, asyn = run(False), run(True)
    assert [items for _, items, *_ in sync[:3]] == [[(0, 32), (1, 16)], [(0, 1), (1, 1)],
                                                    [(1, 1), (2, 64)]]
    assert [items for _, items, *_ in asyn[:4]] == [[(0, 32), (1, 16)], [(0, 1), (1, 1)],
                                                    [(1, 1)], [(1, 1), (2, 64)]]
    assert asyn[2][3] == 5                    # step 3 scheduled with A's 3 blocks held


def test_a_lone_requests_token_times_are_unchanged():
    # prompt 16, 4 tokens: the prefill's step makes the first (at 1 s), each decode one more;
    # four steps either way: a length stop wastes no step (the last token has no placeholder)
    rows = []
    for async_scheduling in (False, True):
        req = Request(0, 0.0, 16, 4)
        sched = scheduler()
        steps = drive(sched, [(0.0, req)], async_scheduling=async_scheduling)
        rows.append((len(steps), req.first_token_s, req.finish_s, list(sched.itl_s)))
    assert rows[0] == rows[1] == (4, 1.0, 4.0, [1.0, 1.0, 1.0])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_arrival_at_an_idle_engine_is_scheduled_at_once(async_scheduling):
    req = Request(0, 2.5, 16, 3)
    steps = drive(scheduler(), [(2.5, req)], async_scheduling=async_scheduling)
    assert [start for start, *_ in steps] == [2.5, 3.5, 4.5]
    assert (req.first_token_s, req.finish_s) == (3.5, 5.5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_empty_schedule_at_a_steps_start_is_made_again_at_its_end(async_scheduling):
    # A's last token is step 2's, so the plan made as step 2 starts is empty; B arrived
    # during step 2 and is scheduled when it ends, in step 3, as without async
    a, b = Request(0, 0.0, 16, 2), Request(1, 1.5, 16, 2)
    steps = drive(scheduler(), [(0.0, a), (1.5, b)], async_scheduling=async_scheduling)
    assert [items for _, items, *_ in steps] == [[(0, 16)], [(0, 1)], [(1, 16)], [(1, 1)]]


def preempted_in_flight(output_b: int):
    """Pool of 4 blocks; A (16 + 20 tokens) and B (16 + `output_b`) decode side by side until
    step 18, which computes token 32 for both and needs a third block each. The schedule of
    step 18 (made as step 17 starts) preempts B while step 17, which samples B's 17th token,
    runs. Returns (B, the scheduler's state right after step 17, the steps)."""
    a, b = Request(0, 0.0, 16, 20), Request(1, 0.0, 16, output_b)
    sched = scheduler(num_blocks=4)
    after = {}

    def on_step(plan, end_s):
        if end_s == 17.0:
            seq = b.all_seqs[0]
            after.update(status=b.status, outputs=seq.num_output_tokens,
                         tokens=seq.num_tokens, computed=seq.num_computed_tokens,
                         last_token_s=seq.last_token_s, preemptions=b.num_preemptions)
    steps = drive(sched, [(0.0, a), (0.0, b)], async_scheduling=True, on_step=on_step)
    return b, after, steps


def test_a_request_preempted_while_its_token_is_computed_keeps_the_token():
    b, after, steps = preempted_in_flight(30)
    assert after == {"status": RequestStatus.WAITING, "outputs": 17, "tokens": 33,
                     "computed": 0, "last_token_s": 17.0, "preemptions": 1}
    assert steps[17][1] == [(0, 1)]             # step 18: A alone
    # back after A is done, B recomputes its 33 tokens, the kept one too, and goes on
    assert (1, 33) in steps[first_step_of(steps[18:], 1) + 17][1]
    assert b.status == RequestStatus.COMPLETED and b.all_seqs[0].num_output_tokens == 30


def test_a_request_preempted_while_its_last_token_is_computed_completes_when_it_comes():
    b, after, _ = preempted_in_flight(17)
    assert after["status"] == RequestStatus.COMPLETED and after["outputs"] == 17
    assert (b.status, b.finish_s, b.num_preemptions) == (RequestStatus.COMPLETED, 17.0, 1)


# --- the key ---------------------------------------------------------------------------------


def test_async_scheduling_is_off_by_default_under_both_semantics():
    from simkv.config.scenario import load_scenario
    assert not load_scenario(minimal()).scheduler.async_scheduling
    assert not load_scenario(minimal(semantics="vllm-0.18")).scheduler.async_scheduling


@pytest.mark.parametrize("top, key", [
    ({"scheduler": {"async_scheduling": True, "parallel_sampling": "fork"}},
     "scheduler.parallel_sampling: 'fork' with scheduler.async_scheduling true"),
    ({"semantics": "vllm-0.18", "scheduler": {"async_scheduling": True}},
     "scheduler.parallel_sampling: 'fork' with scheduler.async_scheduling true"),
    ({"scheduler": {"async_scheduling": True},
      "cache": {"preemption_mode": "swap", "swap_space_gib": 1}},
     "cache.preemption_mode: 'swap' with scheduler.async_scheduling true"),
])
def test_async_scheduling_without_fanout_or_recompute_is_a_one_line_error(top, key):
    from simkv.config.scenario import load_scenario
    with pytest.raises(InputError, match=key) as err:
        load_scenario(minimal(**top))
    assert "\n" not in str(err.value)


def test_the_real_engine_refuses_async_scheduling():
    from simkv.config.scenario import load_scenario
    from simkv.gpu.engine import Engine
    scn = load_scenario(minimal(scheduler={"async_scheduling": True}))
    with pytest.raises(InputError, match="scheduler.async_scheduling: the real engine"):
        Engine(scn, device="cpu")


# --- whole runs ------------------------------------------------------------------------------


def test_a_run_with_async_scheduling_is_the_same_with_and_without_exact(tmp_path):
    """Async runs take every step one by one: --exact changes nothing, byte for byte."""
    scenario = REPO / "scenarios/validation/bursty-cancel-n2-bs16.yaml"
    outs = []
    for extra in ([], ["--exact"]):
        out = tmp_path / ("exact" if extra else "fast")
        done = subprocess.run(
            [sys.executable, "-m", "simkv.cli", "run", str(scenario), "--out", str(out),
             "--set", "scheduler.async_scheduling=true",
             "--set", "workload.synthetic.num_requests=80", *extra], cwd=REPO, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        outs.append(out)
    for name in ("requests.csv", "steps.csv"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()
    fast, exact = (json.loads((o / "summary.json").read_text()) for o in outs)
    fast.pop("wall_time_s"), exact.pop("wall_time_s")
    assert fast == exact


@pytest.mark.parametrize("seed, knobs", [
    (0, {}),
    (1, {"enable_chunked_prefill": False, "max_num_batched_tokens": 256}),
    (2, {"policy": "priority"}),
    (3, {"long_prefill_token_threshold": 16}),
])
def test_contended_runs_with_async_scheduling_leak_nothing(seed, knobs):
    """A tight pool, few seats, n up to 3 fanned out, cancellations and shared prefixes, with
    the KV manager's integrity checked after every step."""
    import simkv
    from simkv.sim.engine import Simulation
    raw = {
        "name": "async-fuzz", "model": "llama-3.1-8b", "cost_model": "roofline", "seed": seed,
        "cache": {"block_size": 8, "num_gpu_blocks_override": 40, "enable_prefix_caching": True,
                  "prefix_sharing_scope": "global"},
        "scheduler": {"async_scheduling": True, "max_num_seqs": 4,
                      "max_num_batched_tokens": 64, "max_model_len": 256, **knobs},
        "workload": {"synthetic": {
            "num_requests": 30, "arrival": {"process": "poisson", "rate": 400},
            "prompt_tokens": {"dist": "uniform", "min": 1, "max": 200},
            "output_tokens": {"dist": "uniform", "min": 1, "max": 40},
            "n": {"dist": "uniform", "min": 1, "max": 3},
            "cancel_fraction": 0.3, "cancel_max_s": 0.05, "tenants": 2,
            "shared_prefix": {"num_groups": 2, "prefix_tokens": 32, "fraction": 0.5,
                              "block_tokens": 8}}},
    }
    sim = Simulation(simkv.load_scenario(raw), check_integrity=True)
    result = sim.run()
    assert result.summary["leaked_blocks"] == 0
    assert result.summary["preemptions"] > 0
    assert set(result.requests["status"]) <= {"completed", "cancelled", "rejected"}
    sched, kv = sim.scheduler, sim.scheduler.kv
    assert not sched.requests and not (sched.waiting or sched.running)
    assert kv.num_used_blocks == 0
    kv.check_integrity()
