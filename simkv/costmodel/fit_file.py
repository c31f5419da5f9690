"""A profile's fit.json as the profiled cost model reads it: checked key by key, so that an
unusable file is one InputError naming the file and the key (re-run `simkv fit`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from simkv.costmodel.step_formula import LOG_BATCH_KNOTS, StepLayout
from simkv.errors import InputError
from simkv.profile.format import FIT_FILE, FIT_FORMAT
from simkv.specs import profiles_dir

STEP_KEYS = ("t_linear_s", "a_decode_s_per_token", "a_prefill_s_per_pair",
             "a_prefill_ctx_s_per_token", "c_seq_s", "c_eager_s", "host_floor_s",
             "host_floor_s_per_seq", "c_mixed_seq_s", "c_mixed_s", "c_prefill_row_s",
             "a_decode_longest_s_per_token", "a_prefill_tail_s_per_token")
LAYOUT_INT_KEYS = ("sm_count", "num_kv_heads", "decode_tile", "max_model_len", "max_num_seqs",
                   "num_heads", "prefill_tile")
LAYOUT_SLOT_KEYS = ("decode_slots_per_sm", "prefill_slots_per_sm")
LAYOUT_MODEL_KEYS = ("sliding_window", "num_experts", "experts_top_k")   # optional (0: none)
# The window and expert terms' coefficients: optional (a dense full-attention fit has none).
OPTIONAL_STEP_KEYS = ("a_window_decode_s_per_token", "a_window_prefill_s_per_pair",
                      "a_expert_s")
SHAPE_KEYS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
              "intermediate_size", "vocab_size")
TRANSFER_KEYS = ("c0_s", "c_block_s", "c_byte_s")
HOST_KEYS = ("c0_s", "c_seq_s", "c_prefill_token_s")


class BlockSizeNotProfiled(InputError):
    """The block size lies outside the profile's block sizes (`cost_model: auto` may fall back
    to the roofline model on this one)."""


def find_profile(gpu_name: str, model_name: str) -> Path | None:
    """`profiles/<gpu>/<model>/fit.json` if it exists, else None."""
    path = profiles_dir() / str(gpu_name).lower() / str(model_name).lower() / FIT_FILE
    return path if path.is_file() else None


def need(obj, key: str, path: Path, where: str = ""):
    if not isinstance(obj, dict) or key not in obj:
        raise InputError(f"{path}: missing key '{where}{key}' (re-run `simkv fit` on the profile)")
    return obj[key]


def numbers(value, key: str, path: Path) -> list:
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float))
                         or not math.isfinite(v) for v in values):
        raise InputError(f"{path}: key '{key}' must be a number or a list of numbers, "
                         f"got {value!r}")
    return [float(v) for v in values]


def blend(lo: dict, hi: dict, f: float) -> dict:
    """Coefficients (1 - f) * lo + f * hi, key by key (lists element-wise)."""
    out = {}
    for key, a in lo.items():
        b = hi[key]
        out[key] = [(1 - f) * x + f * y for x, y in zip(a, b)] if isinstance(a, list) \
            else (1 - f) * a + f * b
    return out


@dataclass
class FitFile:
    """What a fit.json holds: per-block-size step coefficients, the step layout, transfers and
    the engine's host terms (None where the profile has none)."""

    path: Path
    block_sizes: list = field(default_factory=list)
    token_knots: list = field(default_factory=list)
    graph_batch_sizes: list = field(default_factory=list)
    layout: StepLayout = None
    step: dict = field(default_factory=dict)
    swap: dict = field(default_factory=dict)
    copy: dict | None = None
    engine_host: dict | None = None
    serving_host: dict | None = None

    def coefs_for(self, block_size: int) -> tuple:
        """(coefficients at `block_size`, the (lo, hi) block sizes they were interpolated
        between in log2(block size), or None when it was profiled)."""
        sizes = self.block_sizes
        if block_size in self.step:
            return dict(self.step[block_size]), None
        if not sizes[0] < block_size < sizes[-1]:
            raise BlockSizeNotProfiled(
                f"{self.path}: block size {block_size} is outside the profiled block sizes "
                f"{', '.join(map(str, sizes))} (profile it, or pick one in that range)")
        hi = next(b for b in sizes if b > block_size)
        lo = max(b for b in sizes if b < block_size)
        f = (math.log2(block_size) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
        return blend(self.step[lo], self.step[hi], f), (lo, hi)


def read_fit(fit: dict, path: Path, model=None) -> FitFile:
    """Check a fit.json's contents (`model`, optional: its shape must be the profiled one)."""
    read = FitFile(Path(path))
    _read_header(read, fit, path)
    read.layout = _read_layout(fit, path, read.token_knots, read.graph_batch_sizes)
    step = need(fit, "step", path)
    read.step = {bs: _read_step(need(step, str(bs), path, "step."), bs, path,
                                len(read.token_knots)) for bs in read.block_sizes}
    _read_transfers(read, fit, path)
    read.engine_host = _host_terms(fit.get("engine_host"), path, "engine_host.")
    read.serving_host = _read_serving_host(fit.get("serving_host"), path)
    _check_shape(fit, path, model)
    return read


def _read_header(read: FitFile, fit: dict, path: Path) -> None:
    if not isinstance(fit, dict):
        raise InputError(f"{path}: expected a JSON object written by `simkv fit`")
    fmt = need(fit, "format", path)
    if fmt != FIT_FORMAT:
        raise InputError(f"{path}: key 'format' is {fmt!r}, expected {FIT_FORMAT!r} (re-run "
                         f"`simkv fit {path.parent}` on the profile's measurements)")
    for key in ("gpu", "model"):
        need(fit, key, path)
    sizes = need(fit, "block_sizes", path)
    if not isinstance(sizes, list) or not sizes or any(
            isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in sizes):
        raise InputError(f"{path}: key 'block_sizes' must be a list of positive integers")
    read.block_sizes = sorted(sizes)
    read.token_knots = numbers(need(fit, "token_knots", path), "token_knots", path)
    read.graph_batch_sizes = sorted(int(b) for b in numbers(
        fit.get("graph_batch_sizes") or [0], "graph_batch_sizes", path) if b > 0)


def _read_layout(fit: dict, path: Path, token_knots, graph_batch_sizes) -> StepLayout:
    layout = need(fit, "layout", path)
    if not isinstance(layout, dict):
        raise InputError(f"{path}: key 'layout' must be an object")
    fields = {key: int(numbers(need(layout, key, path, "layout."), f"layout.{key}", path)[0])
              for key in LAYOUT_INT_KEYS}
    for key in LAYOUT_SLOT_KEYS:
        slots = numbers(need(layout, key, path, "layout."), f"layout.{key}", path)[0]
        if slots < 0:
            raise InputError(f"{path}: key 'layout.{key}' must be >= 0, got {slots:g}")
        fields[key] = slots
    for key in LAYOUT_MODEL_KEYS:
        value = int(numbers(layout.get(key, 0), f"layout.{key}", path)[0])
        if value < 0:
            raise InputError(f"{path}: key 'layout.{key}' must be >= 0, got {value}")
        fields[key] = value
    if bool(fields["num_experts"]) != bool(fields["experts_top_k"]) \
            or fields["experts_top_k"] > fields["num_experts"]:
        raise InputError(f"{path}: keys 'layout.num_experts' and 'layout.experts_top_k' must "
                         "both be 0 or 0 < experts_top_k <= num_experts")
    in_order = need(layout, "decode_tail_in_order", path, "layout.")
    if not isinstance(in_order, bool):
        raise InputError(f"{path}: key 'layout.decode_tail_in_order' must be true or false")
    sizes = need(layout, "mixed_token_sizes", path, "layout.")
    sizes = numbers(sizes, "layout.mixed_token_sizes", path) if sizes else []
    return StepLayout(tuple(token_knots), tuple(graph_batch_sizes), **fields,
                      decode_tail_in_order=in_order,
                      mixed_token_sizes=tuple(sorted(int(t) for t in sizes)))


def _read_step(entry: dict, bs: int, path: Path, num_knots: int) -> dict:
    coefs = {}
    for key in STEP_KEYS:
        value = numbers(need(entry, key, path, f"step.{bs}."), f"step.{bs}.{key}", path)
        coefs[key] = value if key in ("t_linear_s", "a_decode_s_per_token") else value[0]
    for key in OPTIONAL_STEP_KEYS:
        if key in entry:
            coefs[key] = numbers(entry[key], f"step.{bs}.{key}", path)[0]
    if len(coefs["t_linear_s"]) != num_knots:
        raise InputError(f"{path}: key 'step.{bs}.t_linear_s' has "
                         f"{len(coefs['t_linear_s'])} values for {num_knots} token_knots")
    if len(coefs["a_decode_s_per_token"]) not in (1, len(LOG_BATCH_KNOTS)):
        raise InputError(f"{path}: key 'step.{bs}.a_decode_s_per_token' must have 1 or "
                         f"{len(LOG_BATCH_KNOTS)} values")
    return coefs


def _terms(entry: dict, keys, path: Path, where: str) -> dict:
    return {k: numbers(need(entry, k, path, where), f"{where}{k}", path)[0] for k in keys}


def _read_transfers(read: FitFile, fit: dict, path: Path) -> None:
    for direction in ("out", "in"):
        entry = (fit.get("swap") or {}).get(direction)
        if entry is not None:
            read.swap[direction] = _terms(entry, TRANSFER_KEYS, path, f"swap.{direction}.")
    copy = fit.get("copy")
    read.copy = None if copy is None else _terms(copy, TRANSFER_KEYS, path, "copy.")


def _host_terms(entry, path: Path, where: str) -> dict | None:
    return None if entry is None else _terms(entry, HOST_KEYS, path, where)


def _read_serving_host(serving, path: Path) -> dict | None:
    """The host as the profile's serving pass measured it: outside the executor (instead of the
    offline pass's engine_host) and the input preparation inside it, against the preparation
    inside the profiled times (grid_prep)."""
    if serving is None:
        return None
    if not isinstance(serving, dict):
        raise InputError(f"{path}: serving_host must be an object (re-run simkv fit)")
    out = {part: _host_terms(need(serving, part, path, "serving_host."), path,
                             f"serving_host.{part}.")
           for part in ("outside", "prep", "grid_prep") if part in serving}
    for part in ("outside", "prep"):
        if part not in out:
            raise InputError(f"{path}: serving_host needs '{part}' (re-run simkv fit)")
    return out


def _check_shape(fit: dict, path: Path, model) -> None:
    shape = fit.get("model_shape")
    if model is not None and isinstance(shape, dict):
        diff = [k for k in SHAPE_KEYS if k in shape and getattr(model, k) != shape[k]]
        if diff:
            raise InputError(f"{path}: profiled model {fit['model']} differs from "
                             f"{model.name} in {', '.join(diff)} (profile this model, or use "
                             "cost_model: roofline)")
