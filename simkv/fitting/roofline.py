"""Roofline calibration: the roofline model's efficiency factors fitted to a measured profile.

`calibrate_roofline` fits `RooflineParams` on one profile's step times; `roofline_error`
predicts another profile's step times with them, which is how far a roofline what-if on an
unprofiled GPU or model can be trusted; `write_roofline_calibration` writes
`profiles/<gpu>/roofline_calibration.json`, which `simkv.costmodel` loads.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from simkv.fitting.numerics import nnls, rel_error_summary, round_sig
from simkv.fitting.profile import read_csv, read_meta
from simkv.fitting.step_design import STEP_COLUMNS
from simkv.fitting.transfers import TRANSFER_COLUMNS


def _plans_from_steps(steps: pd.DataFrame) -> list:
    from simkv.engine.plan import StepPlan
    plans = []
    for r in steps.itertuples(index=False):
        plan = StepPlan(step=0, now_s=0.0,
                        scheduled=[None] * int(r.num_prefill_seqs + r.num_decode_seqs),
                        num_prefill_tokens=int(r.num_prefill_tokens),
                        num_decode_tokens=int(r.num_decode_tokens),
                        num_prefill_seqs=int(r.num_prefill_seqs),
                        decode_context_tokens=int(r.decode_context_tokens),
                        prefill_context_tokens=int(r.prefill_context_tokens),
                        prefill_attention_pairs=int(r.prefill_attention_pairs))
        plans.append(plan)
    return plans


def _profile_specs(profile_dir: Path):
    from simkv.specs import load_gpu, load_model
    meta = read_meta(profile_dir)
    model = load_model(meta.get("model", profile_dir.name))
    gpu = load_gpu(meta.get("gpu", profile_dir.parent.name))
    return model, gpu, meta


GRAPH_MAX_BATCH = 256      # decode-only steps up to this batch run as CUDA graphs


def _roofline_terms(model, gpu, steps: pd.DataFrame, kv_dtype="bf16") -> dict:
    """Per-step raw quantities the roofline model combines, at 100% efficiency (seconds)."""
    from simkv.costmodel.roofline import RooflineCostModel, RooflineParams
    ones = RooflineParams(bandwidth_efficiency=1.0, flops_efficiency=1.0,
                          attention_flops_efficiency=1.0, step_overhead_s=0.0,
                          per_seq_overhead_s=0.0)
    m = RooflineCostModel(model, gpu, kv_dtype, 16, ones)
    tokens = (steps["num_prefill_tokens"] + steps["num_decode_tokens"]).to_numpy(float)
    sampled = (steps["num_decode_tokens"] + steps["num_prefill_seqs"]).to_numpy(float)
    flops = m.flops_per_token * tokens + m.flops_per_sample * sampled
    kv = (steps["decode_context_tokens"] + steps["prefill_context_tokens"]).to_numpy(float) \
        + tokens
    eager = ((steps["num_prefill_tokens"] > 0)
             | (steps["num_decode_seqs"] > GRAPH_MAX_BATCH)).to_numpy(float)
    return {
        "weight_s": np.full(len(steps), m.weight_bytes / gpu.hbm_bandwidth_bytes_per_s),
        "flop_s": flops / gpu.bf16_flops_per_s,
        "kv_s": kv * m.kv_bytes_per_token / gpu.hbm_bandwidth_bytes_per_s,
        "attn_s": steps["prefill_attention_pairs"].to_numpy(float) * m.attn_flops_per_pair
        / gpu.bf16_flops_per_s,
        "seqs": (steps["num_prefill_seqs"] + steps["num_decode_seqs"]).to_numpy(float),
        "eager": eager,
        "layers": float(model.num_layers),
    }


def _overhead_columns(q: dict, extended: bool) -> np.ndarray:
    """Overhead design columns: [attention, per-step, per-seq] or, extended, [attention,
    per layer of a graphed step, per layer of an eager step, per-seq]."""
    if extended:
        return np.column_stack([q["attn_s"], (1.0 - q["eager"]) * q["layers"],
                                q["eager"] * q["layers"], q["seqs"]])
    return np.column_stack([q["attn_s"], np.ones(len(q["seqs"])), q["seqs"]])


def calibrate_roofline(profile_dir, extended: bool = False) -> dict:
    """Roofline efficiency factors fitted to a profile's measured step times, with their error.

    Grid search (step 0.01) over the bandwidth and FLOP efficiencies (the roofline's max()
    makes those non-linear); for each pair the attention efficiency and the overheads are a
    non-negative least-squares fit of relative error. Returns {"params", "error", "profile",
    "form"}: params are RooflineParams fields; `extended` is the second form (a graphed
    and an eager step's overhead, each per layer: `graph_overhead_s_per_layer`,
    `eager_overhead_s_per_layer`), which the roofline model loads when the calibration has it.
    host_link_efficiency comes from the profile's measured swap bandwidth.
    """
    profile_dir = Path(profile_dir)
    model, gpu, _ = _profile_specs(profile_dir)
    steps = read_csv(profile_dir / "steps.csv", STEP_COLUMNS)
    t = steps["time_s"].to_numpy(float)
    q = _roofline_terms(model, gpu, steps)
    x = _overhead_columns(q, extended)
    best = None
    grid = np.round(np.arange(0.30, 1.0001, 0.01), 2)
    for bw in grid:
        for fl in grid:
            base = np.maximum(q["weight_s"] / bw, q["flop_s"] / fl) + q["kv_s"] / bw
            c = nnls(x / t[:, None], (t - base) / t)
            score = float(np.sqrt(np.mean(((base + x @ c - t) / t) ** 2)))
            if best is None or score < best[0] - 1e-12:
                best = (score, bw, fl, c)
    _, bw, fl, c = best
    params = {"bandwidth_efficiency": float(bw), "flops_efficiency": float(fl),
              "attention_flops_efficiency": round_sig(1.0 / c[0] if c[0] > 1.0 else 1.0, 4)}
    if extended:
        params.update(graph_overhead_s_per_layer=round_sig(float(c[1]), 4),
                      eager_overhead_s_per_layer=round_sig(float(c[2]), 4),
                      per_seq_overhead_s=round_sig(float(c[3]), 4))
    else:
        params.update(step_overhead_s=round_sig(float(c[1]), 4),
                      per_seq_overhead_s=round_sig(float(c[2]), 4))
    swap = profile_dir / "swap.csv"
    if swap.is_file():
        df = read_csv(swap, TRANSFER_COLUMNS)
        big = df["bytes"] >= df["bytes"].quantile(0.75)
        bw_host = float(np.median(df["bytes"][big] / df["time_s"][big]))
        params["host_link_efficiency"] = round_sig(min(1.0, bw_host / gpu.host_link_bytes_per_s), 4)
    return {"params": params, "error": roofline_error(params, profile_dir),
            "profile": profile_dir.name, "form": "roofline+eager" if extended else "roofline"}


def roofline_error(params, other_profile_dir) -> dict:
    """{median, p95, max, count} relative error of the roofline with `params` (a RooflineParams
    or a dict of its fields) against another profile's measured step times. Params of the
    extended form (with `eager_overhead_s_per_layer`) are evaluated with that form."""
    from simkv.costmodel.roofline import RooflineCostModel, RooflineParams
    other_profile_dir = Path(other_profile_dir)
    model, gpu, meta = _profile_specs(other_profile_dir)
    steps = read_csv(other_profile_dir / "steps.csv", STEP_COLUMNS)
    if isinstance(params, dict) and "eager_overhead_s_per_layer" in params:
        q = _roofline_terms(model, gpu, steps)
        bw, fl = params["bandwidth_efficiency"], params["flops_efficiency"]
        graph = params["graph_overhead_s_per_layer"]
        c = np.array([1.0 / params["attention_flops_efficiency"], graph,
                      params["eager_overhead_s_per_layer"], params["per_seq_overhead_s"]])
        pred = np.maximum(q["weight_s"] / bw, q["flop_s"] / fl) + q["kv_s"] / bw \
            + _overhead_columns(q, True) @ c
        return rel_error_summary(pred, steps["time_s"].to_numpy(float))
    if isinstance(params, dict):
        params = RooflineParams(**{k: v for k, v in params.items()
                                   if k in RooflineParams.__dataclass_fields__})
    pred, meas = [], []
    for bs, group in steps.groupby("block_size"):
        m = RooflineCostModel(model, gpu, meta.get("kv_dtype", "bf16"), int(bs), params)
        pred += [m.predict(p) for p in _plans_from_steps(group)]
        meas += group["time_s"].tolist()
    return rel_error_summary(pred, meas)


def write_roofline_calibration(profile_dir, other_profile_dirs=(), out=None) -> dict:
    """Calibrate the roofline on `profile_dir`, measure its error on the other profiles, and
    write the result (default `profiles/<gpu>/roofline_calibration.json`); returns it.

    Keys: `calibrated_on` (model), `gpu`, `params` (RooflineParams fields, the form the
    roofline model has today), `error_on_calibration`, `error` ({model: {median, p95, max,
    count}} for each other profile), and `proposed`: the same for the extended form (see
    `calibrate_roofline`).
    """
    profile_dir = Path(profile_dir)
    meta = read_meta(profile_dir)
    result = {"calibrated_on": meta.get("model", profile_dir.name),
              "gpu": meta.get("gpu", profile_dir.parent.name)}
    for key, extended in (("current", False), ("proposed", True)):
        cal = calibrate_roofline(profile_dir, extended)
        entry = {"params": cal["params"], "error_on_calibration": cal["error"],
                 "error": {read_meta(Path(d)).get("model", Path(d).name):
                           roofline_error(cal["params"], d) for d in other_profile_dirs}}
        if key == "current":
            result.update(entry)
        else:
            result["proposed"] = dict(entry, formula=(
                "t = max(weights/(bw*eff_bw), flops/(flops*eff_fl)) + kv_bytes/(bw*eff_bw) + "
                "attention_flops/(flops*eff_attn) + [graphed] * num_layers * "
                "graph_overhead_s_per_layer + [eager] * num_layers * eager_overhead_s_per_layer "
                "+ per_seq_overhead_s * "
                f"num_seqs; eager = any prefill token or more than {GRAPH_MAX_BATCH} decodes"))
    result["method"] = ("grid search (step 0.01) over bandwidth and FLOP efficiencies; attention "
                        "efficiency and overheads by non-negative least squares on relative "
                        "error; host_link_efficiency = measured swap bandwidth / spec")
    path = Path(out) if out is not None else profile_dir.parent / "roofline_calibration.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result
