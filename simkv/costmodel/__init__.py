"""Step-cost models: `predict(plan) -> seconds`. Roofline (from specs) and profiled (fitted).

A model may keep state across the steps of a run (the GPU's clock: `simkv.costmodel.clock`):
such a model has `reset()`, which the simulator calls when a run starts, and expects `predict`
once per executed step, in time order."""
from __future__ import annotations

from pathlib import Path

from simkv.errors import InputError


ALL_EFFECTS = ("clock", "shared_reads", "engine_host")


def load_cost_model(scenario):
    """Pick the scenario's cost model: auto | roofline | profile | PATH to a fit.json, with the
    scenario's `effects` layered on a profile's fitted forward time (clock: the GPU's clock
    state, shared_reads: repeated reads of shared blocks from L2, engine_host: the engine's
    host time around each step); with `step_time_scale` other than 1, its step times that many
    times (beneath the clock state when there is one: `ClockedCostModel(scale=...)`, else
    `simkv.costmodel.scaled`). A model whose effects are not all of them says which it has
    in its name (`gpu_clock: fixed` needs no saying)."""
    from simkv.costmodel.clock import ClockedCostModel
    model = _load(scenario)
    scale = getattr(scenario, "step_time_scale", 1.0)
    if scale != 1.0 and not isinstance(model, ClockedCostModel):   # that one takes the scale
        from simkv.costmodel.scaled import ScaledCostModel
        model = ScaledCostModel(model, scale)
    effects = _effects(scenario)
    if set(effects) != set(_effects(scenario, ALL_EFFECTS)) \
            and not getattr(model, "is_estimate", False):
        model.name = f"{model.name} (effects: {', '.join(effects) or 'none'})"
    return model


def _effects(scenario, effects=None) -> tuple:
    """The scenario's effects (or `effects`), less the clock under `gpu_clock: fixed`."""
    effects = tuple(getattr(scenario, "effects", ALL_EFFECTS) if effects is None else effects)
    if getattr(scenario, "gpu_clock", "auto") == "fixed":
        effects = tuple(e for e in effects if e != "clock")
    return effects


def _load(scenario):
    choice = scenario.cost_model
    cache = scenario.cache
    tp = getattr(scenario, "tensor_parallel_size", 1)   # > 1: the TP profile, or roofline
    if choice in ("auto", "profile") or (choice not in ("roofline",) and Path(choice).suffix):
        try:
            from simkv.costmodel.profiled import (BlockSizeNotProfiled, ProfiledCostModel,
                                                  find_profile)
        except ImportError:   # no profiled model in this build
            find_profile = None
        path = None
        if choice not in ("auto", "profile"):
            path = Path(choice)
            if not path.exists():
                raise InputError(f"cost_model: {path} does not exist (auto, profile, roofline "
                                 "or a path to a fit.json)")
        elif find_profile is not None:
            from simkv.parallel import profile_name
            path = find_profile(scenario.gpu.name, profile_name(scenario.model.name, tp))
        if path is not None and find_profile is not None:
            try:
                if tp > 1:
                    from simkv.costmodel.tensor_parallel import load_profiled
                    profiled = load_profiled(path, scenario)
                else:
                    profiled = ProfiledCostModel.load(
                        path, block_size=cache.block_size, kv_dtype=cache.kv_dtype,
                        model=scenario.model, gpu=scenario.gpu, scheduler=scenario.scheduler)
                return _serving_effects(profiled, scenario)
            except BlockSizeNotProfiled as e:
                if choice != "auto":
                    raise
                fallback = _roofline(scenario)
                fallback.note = f"{fallback.note} (the profile does not apply: {e})"
                return fallback
        if choice == "profile":
            raise InputError(f"cost_model: profile: no profile for gpu {scenario.gpu.name} and "
                             f"model {scenario.model.name}"
                             + (f" at tensor_parallel_size {tp}" if tp > 1 else "")
                             + " (use auto or roofline)")
    elif choice != "roofline":
        raise InputError(f"cost_model: unknown value {choice!r} (auto, profile, roofline, or a "
                         "path to a fit.json)")
    return _roofline(scenario)


def _serving_effects(profiled, scenario):
    """What the profile's measurements beside its fit add: repeated reads of shared blocks
    (shared_reads.json) and the GPU's clock state (clock.json; not with `gpu_clock: fixed`)."""
    from simkv.costmodel.clock import ClockedCostModel, load_clock
    from simkv.costmodel.shared_reads import load_shared_reads
    from simkv.profile.format import CLOCK_FILE
    effects = _effects(scenario)
    profile_dir = profiled.path.parent
    if "shared_reads" in effects:
        profiled.use_shared_reads(load_shared_reads(profile_dir))
    profiled.engine_host_on = "engine_host" in effects
    if "clock" not in effects:
        return profiled
    clock = load_clock(profile_dir)
    if clock is None:
        return profiled
    return ClockedCostModel(profiled, clock, scenario.model, str(profile_dir / CLOCK_FILE),
                            scale=getattr(scenario, "step_time_scale", 1.0))


def _roofline(scenario):
    """The roofline model with the calibrated efficiencies when a calibration exists."""
    from simkv.specs import profiles_dir
    from simkv.costmodel.roofline import RooflineCostModel, load_calibration
    from dataclasses import replace
    from simkv.costmodel.roofline import RooflineParams
    calibration = load_calibration(scenario.gpu.name, profiles_dir())
    params = calibration["params"] if calibration else RooflineParams()
    params = replace(params, expert_skew=getattr(scenario, "expert_skew", 0.0))
    if getattr(scenario, "tensor_parallel_size", 1) > 1:
        from simkv.costmodel.tensor_parallel import roofline
        model = roofline(scenario, params)
        model.note = (f"{calibration['note'] if calibration else model.note}; "
                      f"{model.tensor_parallel_size} GPUs per replica, collectives from "
                      f"{model.collectives.allreduce.source}")
        return model
    model = RooflineCostModel(scenario.model, scenario.gpu, scenario.cache.kv_dtype,
                              scenario.cache.block_size, params)
    if calibration:
        model.note = calibration["note"]
    return model
