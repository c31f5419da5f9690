"""A cost model whose step times are another's times a factor: `step_time_scale`.

Another GPU of the same kind serves a few percent faster or slower than the one a profile was
measured on (docs/validation.md: the bundled H200 profile against three other leases' runs,
TPOT -10% to +4% at load 0.6, -16% to -1% at 0.9). A sweep over the scale
(`--grid step_time_scale=0.95,1,1.05`) shows how much an answer depends on that.
"""
from __future__ import annotations


class ScaledCostModel:
    """`inner`'s predictions times `scale`; everything else is `inner`'s."""

    def __init__(self, inner, scale: float):
        self.inner = inner
        self.scale = float(scale)
        self.name = f"{inner.name}*{self.scale:g}"

    def __getattr__(self, name):       # is_estimate, note, block_size... of the inner model
        if name == "inner" or name.startswith("__"):     # (unpickling: no inner yet)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self) -> None:
        if hasattr(self.inner, "reset"):
            self.inner.reset()

    def predict(self, plan) -> float:
        return self.inner.predict(plan) * self.scale

    def describe(self) -> dict:
        out = dict(self.inner.describe()) if hasattr(self.inner, "describe") else {}
        out["name"] = self.name
        out["step_time_scale"] = self.scale
        return out
