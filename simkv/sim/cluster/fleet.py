"""A fleet: the replicas of a scenario's `cluster:` pools on one SimPy clock, behind a router.

Each replica is the serving loop of one GPU (simkv.engine.loop.serve), with its own scheduler,
KV manager, cost model (its own clock state) and recorder, named `<pool>-<index>`. The driver
answers each loop as the single-replica simulator (simkv.sim.engine) does, with one
difference, the horizon of a decode run (the time of the next event that can reach the
replica):

- routers that depend on the arrival order alone (round_robin, random) have their assignment
  computed before the run; each replica gets its own arrival process over its own requests
  and its horizon is its own next arrival or cancellation, so a replica runs exactly as a
  separate run of its requests would (tests/test_fleet.py) and as fast;
  (they cannot see one another, so each runs on its own clock, one after another);
- the other routers choose at each arrival from the replicas' state: one arrival process
  routes every request. A replica's decode run is planned to its own next cancellation (or, to
  bound the steps timed in vain, the fleet's N-th next arrival, N the pool's replicas), and an
  arrival routed to the replica inside the run cuts it at the end of the step in flight: the
  steps up to there are kept (the cost model's clock state moved over them only), and the next
  plan sees the arrival, as the steps one by one would. What a router reads inside a run is
  what the steps one by one would show: request counts do not change inside a run
  (least_requests, prefix_affinity), and the blocks of the steps that have started are counted
  as in use (least_kv; a run commits its blocks at its end). kv_aware also reads each
  replica's prefix index, whose evictions a run applies at its end: its lookup counts the
  cached blocks that the run's started steps have taken from the free queue (the queue's
  first blocks, in step order) as gone, as they would be. A decode fills blocks that only a
  later turn of its conversation can hit, and a run registers them at its end, so under
  kv_aware a trace with turns takes every step one by one. Under prefill/decode pools the
  horizon is the next event anywhere in the fleet and runs are not cut.

Prefill/decode pools (simkv.sim.cluster.disagg): a request is prefilled on a prefill replica
(its first output token sampled there and not returned), its KV sent over the link to a decode
replica that holds blocks for it, which computes the last prompt token again and emits the
first token the client sees.
"""
from __future__ import annotations

import bisect
import copy
import heapq
import math
import time

import numpy as np
import pandas as pd
import simpy

from simkv.config.cluster import STATE_INDEPENDENT
from simkv.costmodel import load_cost_model
from simkv.engine.build import build_scheduler
from simkv.engine.loop import HORIZON, IDLE, NOW, RunSteps, StepGuard, delay_to, hops, serve
from simkv.engine.metrics import MetricsRecorder, add_input_notes, requests_frame, summarize
from simkv.sim.cluster import summary as fleet_summary
from simkv.sim.cluster.router import READS_KV, Router, assign, hashed_among_first_free
from simkv.sim.executor import CostModelExecutor
from simkv.workload.frames import load_requests_frame, requests_from_frame


class Replica:
    """One replica of a pool: a scheduler, KV manager, cost model, executor and recorder, and
    the driver's bookkeeping for its serving loop."""

    def __init__(self, fleet, pool, index: int, cost_model, step_terms: bool):
        scenario = pool.scenario
        self.fleet, self.pool, self.index = fleet, pool, index
        self.name = f"{pool.name}-{index}"
        self.scenario = scenario
        self.scheduler, self.sizing = build_scheduler(scenario)
        self.cost_model = cost_model
        self.recorder = MetricsRecorder(self.scheduler.kv.num_blocks, scenario.cache.block_size)
        self.executor = CostModelExecutor(cost_model, self.scheduler.kv,
                                          self.scheduler.running, step_terms)
        self.wake = None
        self.arrivals_done = False
        self.served_s = None                 # when its last request became final
        self.next_arrival_s = math.inf       # its own pending arrival (own-horizon mode)
        self.cancel_at: list = []            # heap of its pending cancellation timers
        self.on_step = None                  # called after each step (P/D hand-offs)
        self.process = None                  # its driver (a SimPy process)
        self.run_steps = None                # the decode run in flight (loop.RunSteps)
        self.cut_to = None                   # the step it is cut at (an arrival inside it)
        self.before_schedule = None          # called before the loop plans (P/D parking)
        self.guard = None                    # the run's StepGuard (simkv.engine.loop)

    # -- what a router reads --------------------------------------------------------------------
    def load(self) -> int:
        """Requests the replica holds (queued, running, swapped, receiving KV)."""
        return len(self.scheduler.requests)

    def kv_used_fraction(self) -> float:
        kv = self.scheduler.kv
        used = kv.num_used_blocks
        if self.run_steps is not None:       # the blocks of the run's steps started so far
            used += self.run_steps.run.blocks_taken(self._step_in_flight())
        return used / kv.num_blocks

    def blocks_evicted_in_run(self) -> set:
        """The hashed blocks that the run's steps started so far have taken from the free queue
        (one by one, those steps would have dropped them from the prefix index by now)."""
        return hashed_among_first_free(self.scheduler.kv.pool,
                                       self.run_steps.run.blocks_taken(self._step_in_flight()))

    def _step_in_flight(self) -> int:
        """The step of the run in flight at the fleet's time (k: ends[k - 1] < now <= ends[k];
        step 1 at the run's start)."""
        return max(1, bisect.bisect_left(self.run_steps.ends, self.fleet.env.now))

    # -- events ----------------------------------------------------------------------------------
    def notify(self) -> None:
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def add(self, req, now: float) -> None:
        self.scheduler.add_request(req, now)
        if not math.isnan(req.cancel_after_s):
            self.fleet.cancel_timer(self, req)
        if self.run_steps is not None and self.cut_to is None:
            k = self._step_in_flight()
            if k < len(self.run_steps.ends) - 1:     # the next plan is step k's end's
                self.cut_to = k
                self.process.interrupt()
        self.notify()


class Fleet:
    """One fleet run; `run()` returns a SimResult with the fleet's results (summary keys as
    fleet totals plus `pools`, `replicas`, `router`; a `replica` column in requests and
    steps)."""

    def __init__(self, scenario, trace_df=None, check_integrity: bool = False,
                 cost_model=None, step_terms: bool = False, exact: bool = False):
        self.scenario = scenario
        self.cluster = cluster = scenario.cluster
        from simkv.engine.request_path import refuse_request_path
        refuse_request_path(scenario, "a fleet")
        for pool in cluster.pools:
            refuse_request_path(pool.scenario, "a fleet")
        self.frame = trace_df if trace_df is not None else load_requests_frame(scenario)
        self.check_integrity = check_integrity
        self.env = simpy.Environment()
        self.pools = []                       # [(PoolConfig, [Replica])]
        for pool in cluster.pools:
            model = cost_model or load_cost_model(pool.scenario)
            replicas = [Replica(self, pool, i, copy.deepcopy(model) if i else model, step_terms)
                        for i in range(pool.replicas)]
            self.pools.append((pool, replicas))
        self.replicas = [r for _, rs in self.pools for r in rs]
        policy = cluster.router.policy
        seed = cluster.router.seed if cluster.router.seed is not None else scenario.seed
        # the router chooses among every replica of a role (mixed; or prefill, then decode)
        self.by_role = {}
        for replica in self.replicas:
            self.by_role.setdefault(replica.pool.role, []).append(replica)
        self.routers = {role: Router(cluster.router, rs, seed + k)
                        for k, (role, rs) in enumerate(self.by_role.items())}
        self.disagg = None
        if cluster.disaggregated:
            from simkv.sim.cluster.disagg import Disaggregation
            self.disagg = Disaggregation(self)
        # own horizons: the replicas cannot see one another
        self.own_horizon = policy in STATE_INDEPENDENT and self.disagg is None
        frame = self.frame
        turns = "parent_request_id" in frame and bool((frame["parent_request_id"] >= 0).any())
        step_by_step = exact or step_terms or (
            policy == "kv_aware" and len(self.replicas) > 1 and turns) \
            or self.disagg is not None and policy in READS_KV
        self.decode_runs = not step_by_step
        # routed replicas' runs are cut where an arrival reaches them
        self.cut_runs = self.decode_runs and not self.own_horizon and self.disagg is None
        self.arrival_times: list = []        # the routed arrivals' times, in order
        self.arrived = 0                     # how many of them have arrived
        self._arrivals_left = len(self.replicas) if self.own_horizon else 1
        self.finished = False

    # -- arrivals and cancellations -------------------------------------------------------------
    def _own_arrivals(self, replica, requests):
        """A replica's own requests, exactly as the single-replica simulator feeds them."""
        env = self.env
        for req in requests:
            delay = req.arrival_s - env.now
            if delay > 0:
                replica.next_arrival_s = env.now + delay
                yield env.timeout(delay)
            replica.next_arrival_s = math.inf
            replica.add(req, env.now)
        replica.arrivals_done = True
        replica.notify()
        self._arrival_process_done()

    def _routed_arrivals(self, requests):
        """Every request, routed as it arrives."""
        env = self.env
        mixed = self.routers.get("mixed")
        replicas = self.by_role.get("mixed")
        for req in requests:
            delay = req.arrival_s - env.now
            if delay > 0:
                yield env.timeout(delay)
            self.arrived += 1
            if self.disagg is not None:
                self.disagg.arrive(req, env.now)
                continue
            replicas[mixed.choose(req)].add(req, env.now)
        for replica in self.replicas:
            replica.arrivals_done = True
            replica.notify()
        self._arrival_process_done()

    def _arrival_process_done(self) -> None:
        self._arrivals_left -= 1

    def cancel_timer(self, replica, req) -> None:
        ev = self.env.timeout(req.cancel_after_s)
        heapq.heappush(replica.cancel_at, self.env.now + req.cancel_after_s)
        ev.callbacks.append(lambda _ev, r=replica, rid=req.request_id: self._cancel(r, rid))

    def _cancel(self, replica, request_id: int) -> None:
        heapq.heappop(replica.cancel_at)
        if self.disagg is not None and self.disagg.cancel(request_id):
            return
        replica.scheduler.cancel(request_id)
        replica.notify()

    def _refresher(self):
        """Every refresh_s, the routers take the replicas' state (refresh_s > 0)."""
        env = self.env
        period = self.cluster.router.refresh_s
        while not self.finished:
            for router in self.routers.values():
                router.refresh()
            yield env.timeout(period)

    # -- one replica's loop -----------------------------------------------------------------------
    def _horizon(self, replica) -> float:
        """The next time something can reach the replica (module doc)."""
        cancel = replica.cancel_at[0] if replica.cancel_at else math.inf
        if self.own_horizon:
            return min(replica.next_arrival_s, cancel)
        if self.disagg is not None:
            return self.env.peek()
        ahead = self.arrived + len(self.by_role[replica.pool.role]) - 1
        times = self.arrival_times
        return min(times[ahead] if ahead < len(times) else math.inf, cancel)

    def _drive(self, replica, loop):
        """Run a replica's serving loop on the clock (simkv.engine.loop's protocol)."""
        env = self.env
        scheduler = replica.scheduler
        check = replica.guard.check
        command = next(loop)
        while True:
            if command is NOW:
                reply = env.now
            elif command is HORIZON:
                reply = self._horizon(replica)
            elif type(command) is RunSteps:
                replica.run_steps, ends = command, command.ends
                try:
                    for delay in hops(ends):
                        check(delay)
                        yield env.timeout(delay)
                    reply = env.now
                except simpy.Interrupt:      # an arrival inside: stop at the step's end
                    reply = ends[replica.cut_to]
                    delay = delay_to(env.now, reply)
                    if delay is None:
                        raise RuntimeError(f"{replica.name}: no delay from {env.now!r} to "
                                           f"{reply!r}") from None
                    yield env.timeout(delay)
                replica.run_steps = replica.cut_to = None
            elif command is IDLE:
                if not scheduler.has_unfinished() and replica.arrivals_done \
                        and not (self.disagg and self.disagg.pending_for(replica)):
                    replica.served_s = env.now
                    loop.close()
                    self._replica_done()
                    return
                replica.wake = env.event()
                yield replica.wake
                replica.wake = None
                reply = env.now
            else:
                check(command)
                yield env.timeout(command)
                reply = env.now
            if replica.before_schedule is not None and command is not HORIZON:
                replica.before_schedule(replica)
            command = loop.send(reply)

    def _replica_done(self) -> None:
        if all(r.served_s is not None for r in self.replicas):
            self.finished = True

    # -- the run -----------------------------------------------------------------------------------
    def run(self):
        from simkv.sim.engine import SimResult

        wall_start = time.perf_counter()
        env = self.env
        requests = requests_from_frame(self.frame)
        for replica in self.replicas:       # a replica serves at most every request
            replica.guard = StepGuard(requests, str(self.scenario.path or self.scenario.name))
        if self.own_horizon:
            replicas = self.replicas
            router = self.cluster.router
            seed = router.seed if router.seed is not None else self.scenario.seed
            picks = assign(router.policy, [r.arrival_s for r in requests], len(replicas), seed)
            parts = [[] for _ in replicas]
            for req, pick in zip(requests, picks):
                parts[pick].append(req)
            # Replicas that cannot see one another need no shared clock: each runs on its own,
            # one after another. The steps are the same as on one clock (nothing reaches a
            # replica but its own arrivals and cancellations), without interleaving every
            # replica's working set step by step.
            end_s = 0.0
            for replica, part in zip(self.replicas, parts):
                self.env = env = simpy.Environment()
                env.process(self._own_arrivals(replica, part))
                env.process(self._drive(replica, self._serve(replica)))
                env.run()
                end_s = max(end_s, env.now)
            self.env = simpy.Environment(initial_time=end_s)
            return self._results(wall_start, SimResult)
        self.arrival_times = [req.arrival_s for req in requests]
        env.process(self._routed_arrivals(requests))
        for replica in self.replicas:
            replica.executor.keep_run_state = self.cut_runs
            replica.process = env.process(self._drive(replica, self._serve(replica)))
        if self.cluster.router.refresh_s > 0:
            env.process(self._refresher())
        env.run()
        return self._results(wall_start, SimResult)

    def _serve(self, replica):
        return serve(replica.scheduler, replica.executor, replica.recorder,
                     check_integrity=self.check_integrity,
                     on_step=(lambda plan, end, r=replica: r.on_step(r, end))
                     if replica.on_step is not None else None,
                     decode_runs=self.decode_runs,
                     async_scheduling=replica.scenario.scheduler.async_scheduling,
                     cut_runs=self.cut_runs)

    # -- results ---------------------------------------------------------------------------------
    def _results(self, wall_start: float, SimResult):
        scn = self.scenario
        per_replica, frames, steps = [], [], []
        for replica in self.replicas:
            sched = replica.scheduler
            served = replica.served_s if replica.served_s is not None else self.env.now
            req_df = requests_frame(sched.done)
            summary = summarize(replica.recorder, sched, req_df, sim_duration_s=served,
                                wall_time_s=0.0, slo=scn.slo,
                                cost_model=replica.cost_model.name,
                                block_size=replica.scenario.cache.block_size)
            summary.pop("wall_time_s")
            per_replica.append((replica, summary, req_df))
            step_df = replica.recorder.steps_frame()
            if replica.executor.terms:
                terms = pd.DataFrame(replica.executor.terms).add_prefix("term_")
                step_df = pd.concat([step_df, terms.set_index(step_df.index)], axis=1)
            step_df["replica"] = replica.name
            steps.append(step_df)
            frames.append(req_df.assign(replica=replica.name))
        if self.disagg is not None:
            req_all = self.disagg.requests_frame(per_replica)
        else:
            req_all = pd.concat(frames, ignore_index=True).sort_values(
                "request_id", kind="stable").reset_index(drop=True)
        steps_all = pd.concat(steps, ignore_index=True)
        steps_all = steps_all.sort_values("start_s", kind="stable").reset_index(drop=True)
        summary = fleet_summary.fleet_summary(self, per_replica, req_all, steps_all,
                                              wall_time_s=time.perf_counter() - wall_start)
        summary["wall_time_s"] = time.perf_counter() - wall_start
        add_input_notes(summary, self.frame)
        extra = {"replicas": [r.name for r in self.replicas],
                 # requests.csv's queue_s and vllm_bench.json's ITL (SimResult.requests_csv)
                 "queue_s": req_all["queue_s"].to_numpy(),
                 "itl_s": np.concatenate([np.frombuffer(r.scheduler.itl_s, dtype=np.float64)
                                          for r in self.replicas if len(r.scheduler.itl_s)]
                                         or [np.zeros(0)])}
        return SimResult(summary, req_all.drop(columns=["queue_s"]), steps_all, scn, extra)


def simulate_fleet(scenario, *, trace_df=None, check_integrity: bool = False, cost_model=None,
                   step_terms: bool = False, exact: bool = False):
    """Simulate a scenario with a `cluster:` section (module doc); a SimResult."""
    return Fleet(scenario, trace_df, check_integrity, cost_model, step_terms, exact).run()
