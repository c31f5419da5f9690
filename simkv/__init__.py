"""simkv: a capacity-planning simulator for LLM serving with a paged KV cache.

    import simkv
    scn = simkv.load_scenario("scenarios/quickstart.yaml", overrides={"cache.block_size": 32})
    res = simkv.simulate(scn)    # .summary (dict), .requests, .steps (DataFrames), .write(dir)

Importing simkv never imports torch (only simkv.gpu does, and only when used).
"""
from __future__ import annotations

from simkv._version import __version__
from simkv.config.scenario import load_scenario


def simulate(scenario, **kwargs):
    """Simulate `scenario` (a Scenario from load_scenario) and return its result object.

    Thin wrapper over `simkv.sim.engine.simulate`, imported here lazily so that `import simkv`
    stays light.
    """
    from simkv.sim.engine import simulate as _simulate

    return _simulate(scenario, **kwargs)


__all__ = ["__version__", "load_scenario", "simulate"]
