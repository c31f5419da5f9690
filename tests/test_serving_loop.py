"""The one serving loop (simkv.engine.loop): its clock protocol, and both drivers making the same
decisions on the same requests."""
from __future__ import annotations

import pandas as pd
import pytest

from simkv.engine.loop import IDLE, NOW, serve
from simkv.engine.metrics import MetricsRecorder
from simkv.engine.request import Request

DECISIONS = ["step", "num_prefill_tokens", "num_decode_tokens", "num_running", "num_waiting",
             "kv_blocks_used", "kv_blocks_free", "preempted"]


class FixedSeconds:
    """An executor whose every step takes 10 ms."""

    def __init__(self):
        self.done = []

    def execute(self, plan):
        return 0.01, None

    def step_done(self, plan):
        self.done.append(plan.step)


def tiny_scheduler():
    from simkv.engine.kv.paged import PagedKVCacheManager
    from simkv.engine.scheduler import Scheduler
    return Scheduler(PagedKVCacheManager(64, 16), max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=1024)


def run_until_idle(loop, command, now: float) -> tuple:
    """A clock for the loop: steps advance it by their seconds; returns (now, commands seen)."""
    seen = []
    while command is not IDLE:
        seen.append(command)
        if command is not NOW:
            now += command
        command = loop.send(now)
    return now, seen


def test_the_loop_asks_the_time_runs_steps_and_idles_when_nothing_can_run():
    sched, ex = tiny_scheduler(), FixedSeconds()
    recorder = MetricsRecorder(64, 16)
    loop = serve(sched, ex, recorder)
    assert next(loop) is NOW
    assert loop.send(0.0) is IDLE                  # no request yet
    sched.add_request(Request(0, 0.5, 20, 3), 0.5)
    now, seen = run_until_idle(loop, loop.send(0.5), 0.5)
    assert seen == [0.01, NOW] * 3                 # 3 output tokens: the prefill, 2 decodes
    assert now == pytest.approx(0.53)
    assert ex.done == [2, 3, 4]                    # plan 1 was the empty one
    assert recorder.steps_frame()["start_s"].tolist() == pytest.approx([0.5, 0.51, 0.52])
    with pytest.raises(StopIteration):
        loop.send(None)                            # the driver: nothing more will arrive


def test_a_plan_that_cannot_run_while_requests_wait_is_an_error():
    sched = tiny_scheduler()

    class Stuck:
        def schedule(self, now):
            plan = sched.schedule(now)
            plan.scheduled.clear()
            return plan

        def __getattr__(self, name):
            return getattr(sched, name)

    sched.add_request(Request(0, 0.0, 20, 3), 0.0)
    loop = serve(Stuck(), FixedSeconds(), MetricsRecorder(64, 16))
    next(loop)
    with pytest.raises(RuntimeError, match="nothing can run"):
        loop.send(0.0)


def test_the_real_engine_on_cpu_makes_the_simulators_decisions_step_for_step():
    torch = pytest.importorskip("torch")
    pytest.importorskip("simpy")
    import simkv
    from simkv.gpu.engine import replay
    scn = simkv.load_scenario("scenarios/quickstart.yaml", overrides={
        "model": "tiny", "cache.num_gpu_blocks_override": 24, "cache.block_size": 16,
        "scheduler.max_num_seqs": 6, "scheduler.max_num_batched_tokens": 96,
        "scheduler.max_model_len": 384, "workload.synthetic.num_requests": 14,
        "workload.synthetic.prompt_tokens": {"dist": "uniform", "min": 20, "max": 120},
        "workload.synthetic.output_tokens": {"dist": "uniform", "min": 2, "max": 30}})
    from simkv.workload.frames import load_requests_frame
    requests = load_requests_frame(scn)
    requests["arrival_s"] = 0.0
    measured = replay(scn, device="cpu", realtime=False, trace_df=requests,
                      dtype=torch.float64, attention="reference")
    simulated = simkv.simulate(scn, trace_df=requests)
    assert measured.summary["preemptions"] > 0          # the small pool makes it preempt
    pd.testing.assert_frame_equal(measured.steps[DECISIONS].reset_index(drop=True),
                                  simulated.steps[DECISIONS].reset_index(drop=True))
