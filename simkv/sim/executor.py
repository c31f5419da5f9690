"""The simulator's executor: a step takes the seconds the replica's cost model predicts."""
from __future__ import annotations

from simkv.costmodel.features import annotate_shared_reads


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

    def step_done(self, plan) -> None:
        """Nothing to do after a simulated step."""
