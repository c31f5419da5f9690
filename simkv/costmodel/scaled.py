"""A cost model whose step times are another's times a factor: `step_time_scale`.

Another GPU of the same kind serves a few percent faster or slower than the one a profile was
measured on (docs/validation.md: the bundled H200 profile against three other leases' runs,
TPOT -10% to +4% at load 0.6, -16% to -1% at 0.9). A sweep over the scale
(`--grid step_time_scale=0.95,1,1.05`) shows how much an answer depends on that.
"""
from __future__ import annotations

import math
from functools import partial

from simkv.costmodel.step_cost import TermModel


def _scaled(method, scale: float, plan) -> float:
    return method(plan) * scale


class ScaledCostModel(TermModel):
    """`inner`'s terms and a `step_time_scale` term that makes their sum `scale` times theirs
    (the engine host term too, where `inner` has one); everything else is `inner`'s. A model
    with a clock state takes the scale itself (`ClockedCostModel(scale=...)`): scaled from
    outside, its clock would see the stretch of each step as idle time."""

    decode_run_seconds = None     # decode runs are timed step by step (not the inner model's)

    def __init__(self, inner, scale: float):
        self.inner = inner
        self.scale = float(scale)
        self.name = f"{inner.name}*{self.scale:g}"
        self.term_names = inner.term_names + ("step_time_scale",)

    def __getattr__(self, name):       # is_estimate, note, block_size... of the inner model
        if name == "inner" or name.startswith("__"):     # (unpickling: no inner yet)
            raise AttributeError(name)
        value = getattr(self.inner, name)
        return partial(_scaled, value, self.scale) if name == "host_seconds" else value

    def reset(self) -> None:
        if hasattr(self.inner, "reset"):
            self.inner.reset()

    def term_values(self, plan) -> tuple:
        values = self.inner.term_values(plan)
        return values + ((self.scale - 1.0) * math.fsum(values),)

    def describe(self) -> dict:
        out = dict(self.inner.describe()) if hasattr(self.inner, "describe") else {}
        out["name"] = self.name
        out["step_time_scale"] = self.scale
        return out
