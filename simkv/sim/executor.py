"""The simulator's executor: a step takes the seconds the replica's cost model predicts."""
from __future__ import annotations


class CostModelExecutor:
    """`execute(plan) -> (seconds, None)` from `cost_model.predict`; a model with a state across
    steps (the GPU's clock) starts from an idle GPU when its replica's executor is built."""

    def __init__(self, cost_model):
        if hasattr(cost_model, "reset"):
            cost_model.reset()
        self.cost_model = cost_model
        self._predict = cost_model.predict

    def execute(self, plan) -> tuple:
        return self._predict(plan), None

    def step_done(self, plan) -> None:
        """Nothing to do after a simulated step."""
