"""The simulator's executor: a step takes the seconds the replica's cost model predicts."""
from __future__ import annotations

from simkv.costmodel.features import annotate_shared_reads, decode_run_shared_reads


class CostModelExecutor:
    """`execute(plan) -> (seconds, None)` from `cost_model.predict`; a model with a state across
    steps (the GPU's clock) starts from an idle GPU when its replica's executor is built.

    With `step_terms`, each step's cost terms are kept (`terms`: one dict per step, the
    model's term names -> seconds; `cost_model.cost(plan)`, whose sum is the same seconds)."""

    def __init__(self, cost_model, kv=None, running=(), step_terms: bool = False):
        """`kv` and `running` (the scheduler's KV manager and running requests, only read):
        the cost features the plan does not carry are counted from them
        (simkv.costmodel.features); without `kv`, none."""
        if hasattr(cost_model, "reset"):
            cost_model.reset()
        self.cost_model = cost_model
        self.kv, self.running = kv, running
        self.terms: list = []
        if step_terms:
            self.execute = self._execute_with_terms
        self._predict = cost_model.predict
        self.keep_run_state = False        # a decode run may be cut short (`cut_run`)
        self._state_before_run = None

    def _count_features(self, plan) -> None:
        kv = self.kv
        if kv is not None and kv.num_shared_block_refs:
            annotate_shared_reads(plan, kv, self.running)

    def execute(self, plan) -> tuple:
        self._count_features(plan)
        return self._predict(plan), None

    def _execute_with_terms(self, plan) -> tuple:
        self._count_features(plan)
        cost = self.cost_model.cost(plan)
        self.terms.append(cost.terms)
        return cost.seconds, None

    def run_seconds(self, run, now_s: float, horizon_s: float) -> list:
        """Seconds of a decode run's steps 1, 2, ... (simkv.engine.decode_run), each starting
        where the one before ended, step 1 (scheduled) and each later one that starts before
        `horizon_s` (the next arrival or cancellation), at most `run.max_steps`: what `execute`
        predicts for each step's plan, the model's state advanced over them. A model with
        `decode_run_seconds` times them in closed form; any other one step by step, from
        `run.plan_at`."""
        if self.keep_run_state:
            save = getattr(self.cost_model, "save_state", None)
            self._state_before_run = save() if save is not None else None
        shared = decode_run_shared_reads(run, self.kv)
        fast = getattr(self.cost_model, "decode_run_seconds", None)
        if fast is not None:
            return fast(run, shared, now_s, horizon_s)
        out = []
        predict = self._predict
        for k in range(1, run.max_steps + 1):
            if k > 1 and now_s >= horizon_s:
                break
            plan = run.plan_at(k, now_s)
            if shared is not None:
                plan.decode_shared_context_tokens, plan.decode_shared_block_tokens = shared(k)
            seconds = predict(plan)
            out.append(seconds)
            now_s = now_s + seconds
        return out

    def cut_run(self, run, now_s: float, ends: list) -> None:
        """The run timed last (`run_seconds` from `now_s`) stops after its first len(ends) - 1
        steps (`ends`: its start and those steps' ends): the model's state goes back to where
        it was before the run and moves over those steps only, as if they had been the run."""
        if self._state_before_run is not None:
            self.cost_model.restore_state(self._state_before_run)
        seconds = self.run_seconds(run, now_s, ends[-1])
        if len(seconds) != len(ends) - 1 or any(
                ends[k] + s != ends[k + 1] for k, s in enumerate(seconds)):
            raise RuntimeError("decode run: its steps timed again differ from the first time")

    def step_done(self, plan) -> None:
        """Nothing to do after a simulated step."""
