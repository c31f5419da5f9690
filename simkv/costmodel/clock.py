"""The GPU's clock under its power cap: a state that step times depend on.

Run back to back, a composition settles at an SM clock that falls with the FLOP rate it runs
at (light decode batches stay at the top clock, long prefill chunks settle well below it), and
the clock follows a change of work within tens of milliseconds (the probes, their data and the
fitted figures: research/clock_probe.py, profiles/h200/llama-3.1-8b/clock.json,
docs/profiling.md). A step's time at clock f is

    t(f) = t_full * (1 + s * (f_max / f - 1))

(`s`: the share of the step that scales with the clock), and while a step runs the clock
follows the settling clock of the recent work: the power controller averages the work's settling
clocks over a window (`tau_window_s`; idle counts as f_max) and the clock relaxes toward that
average (time constant `tau_down_s` when it falls, `tau_up_s` when it rises), so that a heavy
step after light work starts near full clock and the clock falls behind it.

A profile times its compositions round after round in the design's order, so similar
compositions follow each other and each is measured near its own settling clock. The clocked
model therefore takes a profiled forward time as the composition's time at its settling clock,
turns it into its full-clock time with that, and times each simulated step at the clock the run
so far has left the GPU in.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path

from simkv.costmodel.step_cost import TermModel
from simkv.errors import InputError, read_json_object
from simkv.profile.format import CLOCK_FILE, CLOCK_FORMAT

MAX_TAU_S = 10.0              # an idle gap is integrated in slices up to 12 time constants


def step_flops(plan, counts: tuple) -> float:
    """FLOPs of a step's forward: dense layers on every token, the LM head on sampled rows,
    attention over every query-key pair (prefill causal pairs and decode contexts); `counts`
    is the model's `ModelSpec.forward_flops()`."""
    return flops_of(plan.num_prefill_tokens + plan.num_decode_tokens,
                    plan.num_decode_tokens + plan.num_prefill_seqs,
                    plan.prefill_attention_pairs + plan.decode_context_tokens, counts)


def flops_of(tokens: int, sampled: int, pairs: int, counts: tuple) -> float:
    """`step_flops` from the step's tokens, sampled rows and attention pairs."""
    per_token, per_sample, per_pair = counts
    return per_token * tokens + per_sample * sampled + per_pair * pairs


@dataclass(frozen=True)
class ClockModel:
    max_mhz: float              # the clock of light work
    min_mhz: float              # the lowest settling clock measured
    knee_tflops: float          # FLOP rate (at full clock) above which the cap lowers the clock
    mhz_per_tflops: float       # settling clock lost per TFLOP/s above the knee
    sensitivity: float          # share of a step's time that scales with 1 / clock
    tau_down_s: float
    tau_up_s: float
    tau_window_s: float = 0.0   # the power controller's averaging window (0: none)

    def settling_mhz(self, tflops: float) -> float:
        """The clock a composition running at `tflops` (at full clock) settles at."""
        f = self.max_mhz - self.mhz_per_tflops * max(0.0, tflops - self.knee_tflops)
        return min(self.max_mhz, max(self.min_mhz, f))

    def slowdown(self, mhz: float) -> float:
        """Step time at `mhz` over step time at max_mhz."""
        return 1.0 + self.sensitivity * (self.max_mhz / mhz - 1.0)

    @classmethod
    def load(cls, path) -> "ClockModel":
        path = Path(path)
        data = read_json_object(path, "run `simkv fit clock`")
        params = data.get("params")
        if data.get("format") != CLOCK_FORMAT or not isinstance(params, dict):
            raise InputError(f"{path}: not a {CLOCK_FORMAT} file (re-run "
                             "`simkv fit clock`)")
        values = {}
        for key, field in cls.__dataclass_fields__.items():
            v = params.get(key, None if field.default is MISSING else field.default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise InputError(f"{path}: params.{key} must be a number >= 0, got {v!r}")
            values[key] = float(v)
        taus = (values["tau_down_s"], values["tau_up_s"], values["tau_window_s"])
        if not 0 < values["min_mhz"] <= values["max_mhz"] or min(taus[:2]) <= 0 \
                or max(taus) > MAX_TAU_S:
            raise InputError(f"{path}: params need 0 < min_mhz <= max_mhz and time constants "
                             f"in (0, {MAX_TAU_S:g}] s")
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


class ClockState:
    """The clock a run has left the GPU at; `run_step` advances it over one step.

    Two stages: the power controller's view of the recent work (`level`: the settling clock of
    the work over the last `tau_window_s`, idle counting as max_mhz) and the clock following it
    (`mhz`, with `tau_down_s` / `tau_up_s`). A step is integrated in slices of SLICE_S, its work
    done at the clock of each slice's start."""

    SLICE_S = 0.004

    def __init__(self, model: ClockModel):
        self.model = model
        m = model
        self._decay_window = math.exp(-self.SLICE_S / m.tau_window_s) if m.tau_window_s else 0.0
        self._decay_down = math.exp(-self.SLICE_S / m.tau_down_s)
        self._decay_up = math.exp(-self.SLICE_S / m.tau_up_s)
        self._settled_after_s = 12 * (m.tau_window_s + max(m.tau_down_s, m.tau_up_s))
        self.reset()

    def reset(self) -> None:
        self.mhz = self.level = self.model.max_mhz
        self.free_at_s = None         # when the last step ended

    def decays(self, dt: float) -> tuple:
        """(window, down, up) decay factors over `dt` seconds."""
        if dt == self.SLICE_S:
            return self._decay_window, self._decay_down, self._decay_up
        m = self.model
        window = math.exp(-dt / m.tau_window_s) if m.tau_window_s else 0.0
        return window, math.exp(-dt / m.tau_down_s), math.exp(-dt / m.tau_up_s)

    def _advance(self, target_mhz: float, dt: float) -> None:
        window, down, up = self.decays(dt)
        self.level = target_mhz + (self.level - target_mhz) * window
        decay = down if self.level < self.mhz else up
        self.mhz = self.level + (self.mhz - self.level) * decay

    def idle(self, seconds: float) -> None:
        """The GPU waits `seconds`: its clock comes back toward max_mhz."""
        if seconds >= self._settled_after_s:
            self.mhz = self.level = self.model.max_mhz
            return
        top, dt = self.model.max_mhz, self.SLICE_S
        window, down, up = self._decay_window, self._decay_down, self._decay_up
        level, mhz = self.level, self.mhz
        while seconds > dt:             # _advance(top, dt), inlined: the simulator's hot path
            level = top + (level - top) * window
            mhz = level + (mhz - level) * (down if level < mhz else up)
            seconds -= dt
        self.level, self.mhz = level, mhz
        if seconds > 0:
            self._advance(top, seconds)

    def run_step(self, start_s: float, full_s: float, target_mhz: float) -> float:
        """Seconds a step of `full_s` (at full clock) takes when it starts at `start_s` and
        pulls the clock toward `target_mhz`; the state moves to the step's end."""
        if self.free_at_s is not None and start_s > self.free_at_s:
            self.idle(start_s - self.free_at_s)
        m, dt = self.model, self.SLICE_S
        top, sensitivity = m.max_mhz, m.sensitivity
        window, down, up = self._decay_window, self._decay_down, self._decay_up
        level, mhz = self.level, self.mhz
        work, seconds = full_s, 0.0
        while work > 0:                 # slowdown() and _advance(), inlined
            rate = 1.0 / (1.0 + sensitivity * (top / mhz - 1.0))
            if work <= rate * dt:
                step = work / rate
                self.level, self.mhz = level, mhz
                self._advance(target_mhz, step)
                seconds += step
                break
            level = target_mhz + (level - target_mhz) * window
            mhz = level + (mhz - level) * (down if level < mhz else up)
            work -= rate * dt
            seconds += dt
        else:
            self.level, self.mhz = level, mhz
        self.free_at_s = start_s + seconds
        return seconds


class ClockedCostModel(TermModel):
    """A profiled cost model whose forward times follow the GPU's clock state (module doc):
    the profile's terms, then `step_time_scale` (the scale's share of them) and `clock` (what
    the clock state adds to, or takes from, the scaled forward pass)."""

    is_estimate = False

    def __init__(self, inner, clock: ClockModel, model, source: str = "", scale: float = 1.0):
        """`scale` (`step_time_scale`): a GPU whose every step takes that many times the
        profile's, at full clock; the clock state follows the steps as they then take."""
        self.inner = inner
        self.clock = clock
        self.state = ClockState(clock)
        self.counts = model.forward_flops()
        self.source = source
        self.scale = float(scale)
        self.name = f"{inner.name}+clock" + (f"*{self.scale:g}" if self.scale != 1.0 else "")
        self.term_names = inner.term_names + ("step_time_scale", "clock")

    def __getattr__(self, name):        # layout, engine_host, block_size... of the profile
        if name == "inner" or name.startswith("__"):     # (unpickling: no inner yet)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self) -> None:
        """Start a run with the GPU idle (full clock)."""
        self.state.reset()

    def save_state(self) -> tuple:
        """The clock state, for `restore_state` (a fleet cutting a decode run short)."""
        state = self.state
        return state.level, state.mhz, state.free_at_s

    def restore_state(self, saved: tuple) -> None:
        state = self.state
        state.level, state.mhz, state.free_at_s = saved

    def term_values(self, plan) -> tuple:
        """The profile's terms, the scale's and the clock's. The forward pass is clocked from
        the step's start; the engine's host time, copies and swaps (which run on the host or
        the copy engines) count as the GPU idling after it."""
        inner = self.inner
        return self._clocked(inner.forward_values(plan), inner.around_values(plan), plan.now_s,
                             plan)

    def _clocked(self, forward_values: tuple, around_values: tuple, start_s: float,
                 plan=None, flops: float = 0.0) -> tuple:
        """A step's terms from the profile's: the step starts at `start_s`, its FLOPs are
        `step_flops(plan)` (or `flops` without a plan); the clock state moves over it."""
        scale = self.scale
        forward, around = math.fsum(forward_values), math.fsum(around_values)
        if forward <= 0:
            return forward_values + around_values + ((scale - 1.0) * around, 0.0)
        if plan is not None:
            flops = step_flops(plan, self.counts)
        full, settling = self.full_clock(forward, flops)
        clocked = self.state.run_step(start_s, full * scale, settling)
        return forward_values + around_values + ((scale - 1.0) * (forward + around),
                                                 clocked - forward * scale)

    def decode_run_seconds(self, run, shared, now_s: float, horizon_s: float) -> list:
        """Seconds of a decode run's steps (CostModelExecutor.run_seconds): the profile's terms
        in closed form (ProfiledCostModel.decode_run_split, or decode_run_values for an eager
        batch), the clock state stepped through them as through single steps. `_clocked`,
        `full_clock`, `ClockState.idle` and `.run_step` are inlined here, the same operations
        in the same order (the simulator spends most of its steps here;
        tests/test_decode_run.py compares the bytes)."""
        out = []
        base, forward_base, around, steps = self._run_terms(run, shared)
        n, fsum = run.n, math.fsum
        per_token, per_sample, per_pair = self.counts
        flops_rows = per_token * n + per_sample * n      # step_flops' first two terms
        pairs = run.context_tokens - n                   # step k's: pairs + n x k
        scale = self.scale
        c = self.clock
        top, low, knee, per_tflops, sensitivity = (c.max_mhz, c.min_mhz, c.knee_tflops,
                                                    c.mhz_per_tflops, c.sensitivity)
        state = self.state
        dt = state.SLICE_S
        window, down, up = state._decay_window, state._decay_down, state._decay_up
        tau_window, tau_down, tau_up = c.tau_window_s, c.tau_down_s, c.tau_up_s
        exp = math.exp
        settled_after = state._settled_after_s
        level, mhz, free_at = state.level, state.mhz, state.free_at_s
        for k in range(1, run.max_steps + 1):
            if now_s >= horizon_s and k > 1:     # step 1 is scheduled
                break
            pairs += n
            if forward_base is None:
                forward, terms = next(steps)
            else:
                terms = next(steps)
                forward = fsum(forward_base + terms)
            if forward <= 0:
                out.append(fsum(base + terms + [(scale - 1.0) * around]))
                now_s = now_s + out[-1]
                continue
            flops = flops_rows + per_pair * pairs
            full, settling = forward, top           # full_clock; min/max as conditionals
            if flops / forward / 1e12 > knee:       # (below the knee its rounds give these)
                for _ in range(2):
                    above = flops / full / 1e12 - knee
                    settling = top - per_tflops * (above if above > 0.0 else 0.0)
                    settling = settling if settling > low else low
                    settling = settling if settling < top else top
                    full = forward / (1.0 + sensitivity * (top / settling - 1.0))
            if free_at is not None and now_s > free_at:     # ClockState.idle
                gap = now_s - free_at
                if gap >= settled_after:
                    mhz = level = top
                else:
                    while gap > dt:
                        level = top + (level - top) * window
                        mhz = level + (mhz - level) * (down if level < mhz else up)
                        gap -= dt
                    if gap > 0:     # ClockState.decays(gap): the one decay it takes
                        level = top + (level - top) * (exp(-gap / tau_window) if tau_window
                                                       else 0.0)
                        mhz = level + (mhz - level) * (exp(-gap / tau_down) if level < mhz
                                                       else exp(-gap / tau_up))
            work, clocked = full * scale, 0.0       # ClockState.run_step
            while work > 0:
                rate = 1.0 / (1.0 + sensitivity * (top / mhz - 1.0))
                slice_work = rate * dt
                if work <= slice_work:
                    piece = work / rate                 # ClockState.decays(piece), likewise
                    level = settling + (level - settling) * (exp(-piece / tau_window)
                                                             if tau_window else 0.0)
                    mhz = level + (mhz - level) * (exp(-piece / tau_down) if level < mhz
                                                   else exp(-piece / tau_up))
                    clocked += piece
                    break
                level = settling + (level - settling) * window
                mhz = level + (mhz - level) * (down if level < mhz else up)
                work -= slice_work
                clocked += dt
            free_at = now_s + clocked
            terms.append((scale - 1.0) * (forward + around))
            terms.append(clocked - forward * scale)
            seconds = fsum(base + terms)
            out.append(seconds)
            now_s = now_s + seconds
        state.level, state.mhz, state.free_at_s = level, mhz, free_at
        return out

    def _run_terms(self, run, shared) -> tuple:
        """(base, forward base, around, steps): the run's constant partials, those of its
        forward terms, its around terms' sum, and a generator of each step's other terms (as
        a list) for steps 1, 2, ...: fsum(base + terms) is the step's forward and around
        terms' sum, fsum(forward base + terms) its forward pass. An eager batch has no forward
        base: its steps come as (forward seconds, every term)."""
        split = self.inner.decode_run_split(run, shared)
        if split is not None:
            forward_base, base, around, varying = split
            return base, forward_base, around, varying
        values = self.inner.decode_run_values(run, shared)
        forward_values, around_values = next(values)

        def steps():
            yield math.fsum(forward_values), list(forward_values + around_values)
            for forward, _ in values:      # the same around terms in every step of a run
                yield math.fsum(forward), list(forward + around_values)
        return [], None, math.fsum(around_values), steps()

    def host_seconds(self, plan) -> float:
        return self.inner.host_seconds(plan) * self.scale

    def full_clock(self, profiled_s: float, flops: float) -> tuple:
        """(full-clock seconds, settling MHz) of a composition the profile timed at its settling
        clock in `profiled_s` (the settling clock follows the full-clock FLOP rate: twice)."""
        c = self.clock       # ClockModel.settling_mhz and .slowdown, inlined (every step)
        top, low, knee, per_tflops, sensitivity = (c.max_mhz, c.min_mhz, c.knee_tflops,
                                                    c.mhz_per_tflops, c.sensitivity)
        full, settling = profiled_s, top
        if flops / profiled_s / 1e12 <= knee:   # at the top clock: both rounds give these
            return full, settling
        for _ in range(2):
            tflops = flops / full / 1e12
            settling = min(top, max(low, top - per_tflops * max(0.0, tflops - knee)))
            full = profiled_s / (1.0 + sensitivity * (top / settling - 1.0))
        return full, settling

    def describe(self) -> dict:
        out = self.inner.describe()
        out["name"] = self.name
        out["clock"] = dict(self.clock.to_dict(), source=self.source,
                            full_clock_times="profiled times at each settling clock")
        out["step_time_scale"] = self.scale
        return out


def load_clock(profile_dir: Path):
    """The profile's clock model (`clock.json` beside its fit.json), or None."""
    path = Path(profile_dir) / CLOCK_FILE
    return ClockModel.load(path) if path.is_file() else None
