"""A step's predicted cost as named terms that sum to its seconds.

Every cost model gives `cost(plan) -> StepCost` and `predict(plan) -> seconds`, the same sum:
a model lists its `term_names` once and computes `term_values(plan)` in that order, so the
simulator's hot path (`predict`) adds the same numbers `explain` prints. The sum is
`math.fsum` (correctly rounded, the same on every Python), so `seconds == fsum(terms)` exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """`terms`: term name -> seconds (a term may be negative: a saving, the clock's speed-up)."""

    terms: dict

    @property
    def seconds(self) -> float:
        return math.fsum(self.terms.values())


def exact_partials(values) -> list:
    """Floats whose exact sum is the exact sum of `values` (Shewchuk's partials, as `math.fsum`
    keeps them): `fsum(exact_partials(c) + v) == fsum(c + v)` for any floats `v`, because
    fsum rounds the exact sum once. A sum with constant terms takes them as their (fewer)
    partials, once, instead of every time."""
    partials: list = []
    for x in values:
        i = 0
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo:
                partials[i] = lo
                i += 1
            x = hi
        partials[i:] = [x]
    return partials


class TermModel:
    """A cost model from `term_names` (a tuple) and `term_values(plan)` (a tuple, same order)."""

    term_names: tuple = ()

    def term_values(self, plan) -> tuple:
        raise NotImplementedError

    def predict(self, plan) -> float:
        """Seconds of one step: the sum of its terms."""
        return math.fsum(self.term_values(plan))

    def cost(self, plan) -> StepCost:
        """The step's terms by name (their sum is `predict(plan)`)."""
        return StepCost(dict(zip(self.term_names, self.term_values(plan))))
