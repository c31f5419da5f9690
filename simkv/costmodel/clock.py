"""The GPU's clock under its power cap: a state that step times depend on.

Measured on the H200 (`benchmarks/clock_probe.py`, profiles/h200/llama-3.1-8b/probes/clock/): run
back to back, a composition settles at an SM clock that falls with the FLOP rate it runs at
(decode batches of up to 128 sequences stay at 1,980 MHz; prefill chunks of 1-8k tokens, at
550-630 TFLOP/s, settle near 1,570-1,670 MHz at the 700 W cap), and the clock follows a change
of work within tens of milliseconds. A step's time at clock f is

    t(f) = t_full * (1 + s * (f_max / f - 1))

(`s`: the share of the step that scales with the clock), and while a step runs the clock
relaxes exponentially toward the step's own settling clock (time constant `tau_down_s` when it
falls, `tau_up_s` when it rises; idle gaps raise it toward f_max).

The profile times every composition interleaved with all the others, so its step times belong
to one clock: the median clock nvidia-smi read beside it (`profile_mhz`). The clocked model turns
a profiled forward time into its full-clock time with that, and times each simulated step at the
clock the run so far has left the GPU in.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from simkv.errors import InputError

CLOCK_FILE = "clock.json"
CLOCK_FORMAT = "simkv-clock-1"


def flop_counts(model) -> tuple:
    """(FLOPs per token of the dense layers, per sampled row of the LM head, per query-key
    pair of attention) of a model spec."""
    embed = model.vocab_size * model.hidden_size
    dense = model.num_params - embed * (1 if model.tie_word_embeddings else 2)
    return 2.0 * dense, 2.0 * embed, 4.0 * model.num_layers * model.num_heads * model.head_dim


def step_flops(plan, counts: tuple) -> float:
    """FLOPs of a step's forward: dense layers on every token, the LM head on sampled rows,
    attention over every query-key pair (prefill causal pairs and decode contexts)."""
    per_token, per_sample, per_pair = counts
    tokens = plan.num_prefill_tokens + plan.num_decode_tokens
    sampled = plan.num_decode_tokens + plan.num_prefill_seqs
    pairs = plan.prefill_attention_pairs + plan.decode_context_tokens
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
    profile_mhz: float          # the clock the profile's step times were measured at

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
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"{path}: unreadable clock model ({' '.join(str(e).split())})") \
                from None
        params = data.get("params") if isinstance(data, dict) else None
        if data.get("format") != CLOCK_FORMAT or not isinstance(params, dict):
            raise InputError(f"{path}: not a {CLOCK_FORMAT} file (re-run "
                             "`python -m simkv.costmodel.clock_fit`)")
        values = {}
        for key in cls.__dataclass_fields__:
            v = params.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise InputError(f"{path}: params.{key} must be a number >= 0, got {v!r}")
            values[key] = float(v)
        if not 0 < values["min_mhz"] <= values["max_mhz"] or values["profile_mhz"] <= 0 \
                or values["tau_down_s"] <= 0 or values["tau_up_s"] <= 0:
            raise InputError(f"{path}: params need 0 < min_mhz <= max_mhz, profile_mhz > 0 and "
                             "time constants > 0")
        return cls(**values)

    def to_dict(self) -> dict:
        return asdict(self)


class ClockState:
    """The clock a run has left the GPU at; `run_step` advances it over one step."""

    def __init__(self, model: ClockModel):
        self.model = model
        self.reset()

    def reset(self) -> None:
        self.mhz = self.model.max_mhz
        self.free_at_s = None         # when the last step ended

    def run_step(self, start_s: float, full_s: float, target_mhz: float) -> float:
        """Seconds a step of `full_s` (at full clock) takes when it starts at `start_s` and
        pulls the clock toward `target_mhz`; the state moves to the step's end."""
        m = self.model
        if self.free_at_s is not None and start_s > self.free_at_s:     # idle: the clock rises
            self.mhz = m.max_mhz + (self.mhz - m.max_mhz) * math.exp(
                -(start_s - self.free_at_s) / m.tau_up_s)
        f0 = self.mhz
        tau = m.tau_down_s if target_mhz < f0 else m.tau_up_s
        seconds = full_s * m.slowdown(f0)
        for _ in range(2):            # the mean clock over the step, at the step's own length
            x = seconds / tau
            mean = target_mhz + (f0 - target_mhz) * (-math.expm1(-x) / x if x > 1e-9 else 1.0)
            seconds = full_s * m.slowdown(mean)
        self.mhz = target_mhz + (f0 - target_mhz) * math.exp(-seconds / tau)
        self.free_at_s = start_s + seconds
        return seconds


class ClockedCostModel:
    """A profiled cost model whose forward times follow the GPU's clock state (module doc)."""

    is_estimate = False

    def __init__(self, inner, clock: ClockModel, model, source: str = ""):
        self.inner = inner
        self.clock = clock
        self.state = ClockState(clock)
        self.counts = flop_counts(model)
        self.to_full = 1.0 / clock.slowdown(clock.profile_mhz)
        self.source = source
        self.name = f"{inner.name}+clock"

    def __getattr__(self, name):        # layout, engine_host, block_size... of the profile
        if name == "inner" or name.startswith("__"):     # (unpickling: no inner yet)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self) -> None:
        """Start a run with the GPU idle (full clock)."""
        self.state.reset()

    def predict(self, plan) -> float:
        forward = self.inner.forward_seconds(plan)
        around = self.inner.around_seconds(plan)
        if forward <= 0:
            return around
        full = forward * self.to_full
        tflops = step_flops(plan, self.counts) / full / 1e12
        # the engine's host time after the forward idles the GPU until the next step starts
        return self.state.run_step(plan.now_s, full, self.clock.settling_mhz(tflops)) + around

    def describe(self) -> dict:
        out = self.inner.describe()
        out["name"] = self.name
        out["clock"] = dict(self.clock.to_dict(), source=self.source)
        return out


def load_clock(profile_dir: Path):
    """The profile's clock model (`clock.json` beside its fit.json), or None."""
    path = Path(profile_dir) / CLOCK_FILE
    return ClockModel.load(path) if path.is_file() else None
