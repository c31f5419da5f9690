"""Bounded sweep of the paged kernels' launch parameters: `python -m simkv.gpu.bench tune`.

Three stages, each started only while the time budget lasts: the decode split policy (programs
per SM, tiles per split) and merge (fused or a second kernel) at small batches, geomean of the
steady time against SDPA's; the decode kernel configuration per block size at 64 x 4096 (not
quick); the prefill tiles at 8 x 2048 new tokens (and 8 x 512 over 2048 cached unless quick).
`run_tune` writes `tune.csv` (every measurement) and `best.json` (the choices, read back by
`load_tuned` for `kernels --configs`, with the constants to set in the code).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from simkv.gpu.kernel_measure import (
    BLOCK_SIZES, DTYPE, HEAD_DIM, NUM_KV_HEADS, TUNED, Budget, baseline_steady, decode_bytes, decode_setup,
    errored, paged_copy, prefill_flops, prefill_setup, rotation, time_decode, time_prefill,
)

# (split programs per SM, min tiles per split) candidates of the decode split rule
TUNE_SPLIT_POLICIES = ((1, 2), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1))
TUNE_DECODE_POINTS = ((1, 4096), (4, 4096), (8, 4096), (1, 16384), (4, 16384), (8, 16384))
TUNE_DECODE_CONFIGS = ((32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 3), (128, 4, 2))
TUNE_PREFILL_POINTS = ((8, 2048, 0), (8, 512, 2048))
TUNE_CONFIG_POINT = (64, 4096)   # decode kernel configuration per block size (unsplit there)
PREFILL_MAX_REL_ERR = 0.02   # bf16 against SDPA; a config above it is wrong, not slow


def prefill_tune_grid() -> list[tuple]:
    """(block_m, block_n, num_warps, num_stages), the current default and earlier front-runners
    first, so that a time budget that ends the sweep early still compares them."""
    first = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3)]
    grid = [(m, n, w, s) for m in (128, 64) for n in (64, 128, 32) for w in (8, 4) for s in (3, 2, 4)]
    return first + [c for c in grid if c not in first]


def _geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("inf")


class _Sweep:
    """What the stages share: the device, generator and time budget, every measurement row and
    note so far, and each stage's results."""

    def __init__(self, device, time_budget_s: float | None):
        from simkv.gpu.kernels._common import sm_count
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(1)
        torch.manual_seed(1)
        self.budget = Budget(time_budget_s)
        self.sms = sm_count(self.device)
        self.rows, self.notes = [], []
        self.times = {}          # (point, splits, fused) -> decode steady µs
        self.splits_of = {}      # (point, policy) -> splits
        self.sdpa_steady = {}    # decode point -> SDPA steady µs
        self.pcost = {}          # PrefillConfig -> {point: µs}
        self.sdpa_prefill = {}   # prefill point -> SDPA µs

    def record(self, stage, point, m, baseline_us=None, **extra) -> dict:
        """Keep one measurement row (and print it)."""
        row = {"stage": stage, "point": "x".join(map(str, point)), **extra, **m}
        if baseline_us is not None and "steady_time_us" in m:
            row["sdpa_steady_us"] = round(baseline_us, 3)
            row["vs_sdpa_steady"] = round(baseline_us / m["steady_time_us"], 3)
        self.rows.append(row)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k not in ("stage", "point")}
        print(f"  {stage} {row['point']} {shown}", flush=True)
        return row


def run_tune(out_dir, quick: bool = False, time_budget_s: float | None = None, device="cuda") -> dict:
    """Sweep launch parameters; write every measurement to `<out_dir>/tune.csv` and the choices
    to `<out_dir>/best.json` (the `kernels --configs` format plus the constants to set in the
    code); return the choices. `quick`: decode split policy and merge at batch 1/4/8 × 4096 and
    16384, and the prefill sweep at 8 × 2048 only. Each stage starts only while `time_budget_s`
    lasts (the prefill sweep checks it before every configuration); failures are recorded."""
    import pandas as pd

    from simkv.gpu.kernels import decode_config, prefill_config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sw = _Sweep(device, time_budget_s)
    base_cfg = TUNED.get("decode_configs", {}).get(16) or decode_config(16, HEAD_DIM, DTYPE)
    _tune_decode_splits(sw, base_cfg)
    points_done = sorted(sw.sdpa_steady)
    scores = _split_policy_scores(sw, points_done)
    best_policy, best_fused = min(scores, key=scores.get) if scores else (
        (None, None), base_cfg.fused_merge)
    best_decode = _tune_decode_configs(sw, quick, best_fused)
    _tune_prefill(sw, quick)
    default_prefill = prefill_config(HEAD_DIM, DTYPE)
    best_prefill = min(sw.pcost, key=lambda c: _prefill_score(sw, c)) if sw.pcost else default_prefill
    evidence = _evidence(sw, scores, points_done, best_prefill, default_prefill)
    best = _best(quick, best_policy, best_fused, best_decode, best_prefill, evidence)
    pd.DataFrame(sw.rows).to_csv(out_dir / "tune.csv", index=False)
    (out_dir / "best.json").write_text(json.dumps(best, indent=2) + "\n")
    _print_tune_summary(scores, sw.splits_of, points_done, sw.times, sw.sdpa_steady, sw.pcost,
                        sw.sdpa_prefill, best)
    return best


def _tune_decode_splits(sw: _Sweep, base_cfg) -> None:
    """Stage 1: the decode split rule and merge (fused or a second kernel) at small batches,
    block size 16, against SDPA's steady time (sw.times, sw.splits_of, sw.sdpa_steady)."""
    import dataclasses

    from simkv.gpu.kernels import decode_num_splits

    for batch, context in TUNE_DECODE_POINTS:
        if sw.budget.left() <= 0:
            sw.notes.append(f"decode point {batch}x{context} not measured (time budget)")
            continue
        point = (batch, context)
        try:
            setup = decode_setup(batch, context, sw.device)
            nbytes = decode_bytes(batch, context)
            sw.sdpa_steady[point] = baseline_steady(setup, nbytes)[0]
            paged = paged_copy(setup.k, setup.v, 16, sw.gen)
            sets = rotation(setup, paged, nbytes, sw.gen)
        except Exception as e:  # noqa: BLE001
            sw.notes.append(f"decode point {point}: {errored('decode setup', point, e)['error']}")
            continue
        for policy in TUNE_SPLIT_POLICIES:
            sw.splits_of[(point, policy)] = decode_num_splits(batch, NUM_KV_HEADS, context, base_cfg.tile, sw.sms,
                                                              split_programs_per_sm=policy[0],
                                                              min_tiles_per_split=policy[1])
        for fused in (True, False):
            cfg = dataclasses.replace(base_cfg, fused_merge=fused)
            for splits in sorted({s for (p, _), s in sw.splits_of.items() if p == point}):
                try:
                    m = time_decode(setup, paged, cfg, splits, sets=sets)
                except Exception as e:  # noqa: BLE001
                    sw.record("decode_splits", point, errored("decode", (point, splits, fused), e),
                              num_splits=splits, fused_merge=fused)
                    continue
                if m["rel_err"] > PREFILL_MAX_REL_ERR:
                    sw.notes.append(f"decode {point} splits {splits} fused {fused}: rel_err {m['rel_err']:.3g}")
                    continue
                sw.times[(point, splits, fused)] = m["steady_time_us"]
                sw.record("decode_splits", point, m, sw.sdpa_steady[point], block_size=16)
        del setup, paged, sets
        torch.cuda.empty_cache()


def _split_policy_scores(sw: _Sweep, points_done: list) -> dict:
    """(policy, fused) -> geomean of its steady time / SDPA's over the points measured, for the
    policies measured at every one of them."""
    scores = {}
    for policy in TUNE_SPLIT_POLICIES:
        for fused in (True, False):
            ratios = [sw.times.get((p, sw.splits_of[(p, policy)], fused)) for p in points_done]
            if points_done and all(r is not None for r in ratios):
                scores[(policy, fused)] = _geomean(t / sw.sdpa_steady[p] for t, p in zip(ratios, points_done))
    return scores


def _tune_decode_configs(sw: _Sweep, quick: bool, best_fused) -> dict:
    """Stage 2 (not quick): the decode kernel configuration per block size at batch 64 × 4096
    (unsplit there); returns block size -> DecodeConfig with the chosen merge, for every block
    size (the tuned or default configuration where none was measured)."""
    import dataclasses

    from simkv.gpu.kernels import DecodeConfig, decode_config

    best_decode = {}
    if not quick and sw.budget.left() > 0:
        batch, context = TUNE_CONFIG_POINT
        try:
            setup = decode_setup(batch, context, sw.device)
            for block_size in BLOCK_SIZES:
                if sw.budget.left() <= 0:
                    break
                paged = paged_copy(setup.k, setup.v, block_size, sw.gen)
                sets = rotation(setup, paged, decode_bytes(batch, context), sw.gen)
                cfg_times = {}
                for c in TUNE_DECODE_CONFIGS:
                    cfg = DecodeConfig(*c, fused_merge=best_fused)
                    try:
                        m = time_decode(setup, paged, cfg, sets=sets)
                    except Exception as e:  # noqa: BLE001
                        sw.record("decode_config", (batch, context, block_size), errored("decode", cfg, e))
                        continue
                    cfg_times[cfg] = m["steady_time_us"]
                    sw.record("decode_config", (batch, context, block_size), m, block_size=block_size)
                if cfg_times:
                    best_decode[block_size] = min(cfg_times, key=cfg_times.get)
                del paged, sets
            del setup
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            sw.notes.append(f"decode config sweep: {errored('decode config sweep', '', e)['error']}")
    for block_size in BLOCK_SIZES:
        cfg = best_decode.get(block_size) or TUNED.get("decode_configs", {}).get(block_size) or decode_config(
            block_size, HEAD_DIM, DTYPE)
        best_decode[block_size] = dataclasses.replace(cfg, fused_merge=best_fused)
    return best_decode


def _tune_prefill(sw: _Sweep, quick: bool) -> None:
    """Stage 3: the prefill tiles at 8 × 2048 new tokens (and 8 × 512 over 2048 cached unless
    quick), block size 16 (sw.pcost, sw.sdpa_prefill)."""
    prefill_points = TUNE_PREFILL_POINTS[:1] if quick else TUNE_PREFILL_POINTS
    for point in prefill_points:
        if sw.budget.left() <= 0:
            sw.notes.append(f"prefill point {point} not measured (time budget)")
            continue
        try:
            setup = prefill_setup(*point, sw.device)
            paged = paged_copy(setup.k, setup.v, 16, sw.gen)
        except Exception as e:  # noqa: BLE001
            sw.notes.append(f"prefill point {point}: {errored('prefill setup', point, e)['error']}")
            continue
        sw.sdpa_prefill[point] = setup.baseline_us
        if point == prefill_points[0]:
            _sweep_prefill_grid(sw, setup, paged, point)
        else:  # the front-runners only
            ranked = sorted(sw.pcost, key=lambda c: sw.pcost[c].get(prefill_points[0], float("inf")))[:4]
            for cfg in ranked:
                if sw.budget.left() <= 0:
                    break
                _measure_prefill(sw, setup, paged, point, cfg)
        del setup, paged
        torch.cuda.empty_cache()


def _sweep_prefill_grid(sw: _Sweep, setup, paged, point) -> None:
    """The front-runners with both ways of loading the block table, then the rest of the grid,
    then the other way for the fastest of the grid not yet tried both ways."""
    import dataclasses

    from simkv.gpu.kernels import PrefillConfig

    grid = [PrefillConfig(*c) for c in prefill_tune_grid()]
    grid = grid[:3] + [dataclasses.replace(c, prefetch_pages=not c.prefetch_pages) for c in grid[:3]] + grid[3:]
    for cfg in grid:
        if sw.budget.left() <= 0:
            sw.notes.append(f"prefill sweep stopped by the time budget before {cfg}")
            break
        _measure_prefill(sw, setup, paged, point, cfg)
    ranked = sorted((c for c in sw.pcost if point in sw.pcost[c]), key=lambda c: sw.pcost[c][point])[:3]
    for cfg in ranked:
        twin = dataclasses.replace(cfg, prefetch_pages=not cfg.prefetch_pages)
        if twin in sw.pcost or sw.budget.left() <= 0:
            continue
        _measure_prefill(sw, setup, paged, point, twin)


def _measure_prefill(sw: _Sweep, setup, paged, point, cfg) -> None:
    """Time one prefill configuration at `point` into sw.pcost; a failure or a wrong result is
    recorded instead."""
    import dataclasses

    flops = prefill_flops(*point)
    try:
        m = time_prefill(setup, paged, cfg, steady=False)
    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
        sw.record("prefill_config", point, errored("prefill", cfg, e), **dataclasses.asdict(cfg))
        return
    if m["rel_err"] > PREFILL_MAX_REL_ERR:
        sw.notes.append(f"prefill {point} {cfg}: rel_err {m['rel_err']:.3g}")
        return
    sw.pcost.setdefault(cfg, {})[point] = m["time_us"]
    sw.record("prefill_config", point, m, block_size=16, tflops=round(flops / m["time_us"] / 1e6, 1),
              sdpa_tflops=round(flops / setup.baseline_us / 1e6, 1), vs_sdpa=round(setup.baseline_us / m["time_us"], 3))


def _prefill_score(sw: _Sweep, cfg) -> float:
    """Geomean of the configuration's time / SDPA's over the prefill points (inf if it missed one)."""
    got = sw.pcost[cfg]
    if any(p not in got for p in sw.sdpa_prefill):
        return float("inf")
    return _geomean(got[p] / sw.sdpa_prefill[p] for p in sw.sdpa_prefill)


def _evidence(sw: _Sweep, scores, points_done, best_prefill, default_prefill) -> dict:
    target = TUNE_PREFILL_POINTS[0]
    pcost, sdpa_prefill = sw.pcost, sw.sdpa_prefill
    return {
        "decode_policy_scores (geomean steady time / SDPA steady over the points)": {
            f"per_sm={p[0]} min_tiles={p[1]} fused={f}": round(v, 4) for (p, f), v in sorted(scores.items(), key=lambda x: x[1])},
        "decode_points_measured": [f"{b}x{c}" for b, c in points_done],
        "prefill_at_8x2048": {
            "sdpa_us": round(sdpa_prefill[target], 2) if target in sdpa_prefill else None,
            "best_us": round(pcost[best_prefill][target], 2) if best_prefill in pcost and target in pcost[best_prefill] else None,
            "default_us": round(pcost[default_prefill][target], 2) if default_prefill in pcost and target in pcost[default_prefill] else None,
        },
        "notes": sw.notes,
    }


def _best(quick, best_policy, best_fused, best_decode, best_prefill, evidence) -> dict:
    """best.json: the `kernels --configs` choices, the constants to set in the code, evidence."""
    import dataclasses
    return {
        # `kernels --configs` reads these
        "decode_configs": {str(b): dataclasses.asdict(c) for b, c in best_decode.items()},
        "split_programs_per_sm": best_policy[0],
        "min_tiles_per_split": best_policy[1],
        "prefill_config": dataclasses.asdict(best_prefill),
        # what to set in the code
        "constants": {
            "simkv/launch_policy.py": {"SPLIT_PROGRAMS_PER_SM": best_policy[0],
                                           "MIN_TILES_PER_SPLIT": best_policy[1]},
            "simkv/gpu/kernels/decode.py": {"DecodeConfig.fused_merge": best_fused,
                                            "decode_config (bf16, head_dim<=128), per block size":
                                                {str(b): [c.tile, c.num_warps, c.num_stages] for b, c in best_decode.items()}},
            "simkv/gpu/kernels/prefill.py": {"PrefillConfig defaults (bf16/fp16, head_dim<=128)":
                                             dataclasses.asdict(best_prefill)},
        },
        "evidence": evidence,
        "quick": quick,
    }


def _print_tune_summary(scores, splits_of, points, times, sdpa_steady, pcost, sdpa_prefill, best) -> None:
    print("\ndecode split policy (steady µs per point; geomean ratio to SDPA steady)")
    header = " ".join(f"{b}x{c:<6d}" for b, c in points)
    print(f"  {'per_sm,min_tiles,fused':24s} {header}  score")
    for (policy, fused), score in sorted(scores.items(), key=lambda x: x[1]):
        cells = " ".join(f"{times[(p, splits_of[(p, policy)], fused)]:8.1f}" for p in points)
        print(f"  {str(policy) + ' ' + str(fused):24s} {cells}  {score:.3f}")
    print(f"  {'sdpa':24s} " + " ".join(f"{sdpa_steady[p]:8.1f}" for p in points))
    if pcost:
        print("\nprefill configurations, fastest first (µs per call; SDPA " +
              ", ".join(f"{'x'.join(map(str, p))}: {t:.1f}" for p, t in sdpa_prefill.items()) + ")")
        first = next(iter(sdpa_prefill), None)
        ranked = sorted(pcost, key=lambda c: pcost[c].get(first, float("inf")))
        for cfg in ranked[:8]:
            cells = " ".join(f"{'x'.join(map(str, p))}: {t:8.1f}" for p, t in pcost[cfg].items())
            print(f"  m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
                  f"prefetch={cfg.prefetch_pages!s:5s} {cells}")
    print("\nbest:", json.dumps({k: best[k] for k in ("decode_configs", "split_programs_per_sm",
                                                      "min_tiles_per_split", "prefill_config")}))
