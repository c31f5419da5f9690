"""Kernel benchmark: the paged kernels against torch SDPA on contiguous KV, on one CUDA GPU.

    python -m simkv.gpu.bench kernels [--out profiles/h200/kernels.csv] [--quick]
                                      [--block-sizes 16] [--time-budget-s S] [--configs best.json]
    python -m simkv.gpu.bench tune [--out DIR] [--quick] [--time-budget-s S]
    python -m simkv.gpu.bench window [--out profiles/h200/kernels-window/window.csv]
                                     [--batch 64] [--context 32768] [--windows 1024] [--block-sizes 16]

`kernels` writes one CSV row per (kernel, batch, context, block size) with the columns of
`COLUMNS` (then extra columns), a metadata JSON beside it (GPU, driver, versions, date, command),
and prints the target points. Shapes: 32 query heads, 8 KV heads, head_dim 128, bfloat16; the
block table is a random permutation of the cache's blocks. Bytes counted per call: K and V read
once, q read and out written once. The baseline is torch SDPA over contiguous
[batch, kv_heads, context, head_dim] K/V of the same shape in the same run; of the ways to call
it (decode: query heads folded into the query length, or `enable_gqa`; prefill: `enable_gqa`, or
K/V expanded to all heads) the fastest is kept and named in `baseline_variant`. One point's
inputs and measurements are in `kernel_measure`.

Two timings (`kernel_timing`), each for our kernel and for the baseline:

* per call (`time_us`, `tbps`, `baseline_time_us`, `baseline_tbps`): one call captured in a CUDA
  graph, its replays timed by `triton.testing.do_bench` (median, L2 flushed before each replay).
* steady state (`steady_time_us`, `steady_tbps`, `baseline_steady_time_us`,
  `baseline_steady_tbps`): `steady_calls` calls back to back in ONE CUDA graph, cycling over
  `steady_sets` input sets (own q, KV cache, block table, output) that no L2 holds together; the
  per-call time is the median replay time / `steady_calls`.

`window` measures sliding-window decode against full-context decode of the same shapes (random
paged K/V made in place, no SDPA baseline): per row the kernel's own count of the K/V pages it
reads (`blocks_loaded`, per KV head; `block_bytes_loaded` = pages x block bytes, K and V), the
bytes of the tokens it attends to (`kv_bytes_loaded`), their fraction of the full context's K/V
bytes, and its per-call time against full context's (`time_ratio`); plus prefill rows with and
without the window (one chunk per sequence over a cached prefix).

`tune` (`kernel_tune`) sweeps launch parameters (decode split policy and merge, prefill tiles)
and writes `tune.csv` (every measurement) and `best.json` (the choices, usable as
`kernels --configs`, with the constants to set in the code) under --out; --quick bounds it to a
few minutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

from simkv.gpu.kernel_measure import (
    BLOCK_SIZES, DTYPE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, TUNED, Budget, baseline_steady, decode_bytes,
    decode_setup, errored, load_tuned, paged_copy, prefill_bytes, prefill_flops, prefill_setup, time_decode,
    time_prefill,
)
from simkv.gpu.kernel_timing import STEADY_CALLS, STEADY_MAX_SETS, STEADY_MIN_BYTES
from simkv.gpu.kernel_tune import run_tune

COLUMNS = [
    "kernel", "batch", "context", "block_size", "num_heads", "num_kv_heads", "head_dim", "dtype",
    "time_us", "tbps", "baseline", "baseline_time_us", "baseline_tbps",
]
BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (512, 2048, 4096, 16384)
# (batch, new tokens per sequence, cached prefix tokens per sequence)
PREFILL_POINTS = ((1, 2048, 0), (8, 512, 0), (8, 2048, 0), (32, 512, 0), (4, 4096, 0),
                  (1, 2048, 2048), (8, 512, 2048), (8, 2048, 2048))
QUICK_BATCHES, QUICK_CONTEXTS = (1, 64, 128), (4096,)
QUICK_PREFILL_POINTS = ((8, 2048, 0), (8, 2048, 2048))
# The target points, measured first so that a time budget never drops them.
TARGET_DECODE = ((1, 4096), (8, 4096), (64, 4096), (128, 4096))
TARGET_PREFILL = ((8, 2048, 0),)
MAX_KV_BYTES = 40e9
DEFAULT_OUT = "profiles/h200/kernels.csv"


def _row(kernel, batch, context, block_size, time_us_, baseline_us, nbytes, **extra) -> dict:
    row = {
        "kernel": kernel, "batch": batch, "context": context, "block_size": block_size,
        "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
        "dtype": str(DTYPE).removeprefix("torch."),
        "time_us": round(time_us_, 3), "tbps": round(nbytes / time_us_ / 1e6, 4),
        "baseline": "sdpa_contiguous", "baseline_time_us": round(baseline_us, 3),
        "baseline_tbps": round(nbytes / baseline_us / 1e6, 4),
    }
    row.update(extra)
    return row


def _steady_columns(m: dict, baseline: tuple | None, nbytes: float) -> dict:
    """The steady-state columns of a row from a measurement and the baseline's steady time."""
    cols = {}
    if "steady_time_us" in m:
        t = m.pop("steady_time_us")
        cols.update(steady_time_us=round(t, 3), steady_tbps=round(nbytes / t / 1e6, 4),
                    steady_calls=m.pop("steady_calls"), steady_sets=m.pop("steady_sets"))
    if baseline is not None:
        cols.update(baseline_steady_time_us=round(baseline[0], 3),
                    baseline_steady_tbps=round(nbytes / baseline[0] / 1e6, 4))
    return cols


def bench_decode_point(batch, context, block_sizes, device, gen, steady: bool = True) -> list[dict]:
    """Rows of one (batch, context) decode point, one per block size; a failure is recorded in an
    `error` column rather than raised."""
    rows = []
    nbytes = decode_bytes(batch, context)
    setup = decode_setup(batch, context, device)
    base = None
    if steady:
        try:
            base = baseline_steady(setup, nbytes)
        except Exception as e:  # noqa: BLE001 - keep the run going
            errored("sdpa steady", (batch, context), e)
    for block_size in block_sizes:
        try:
            paged = paged_copy(setup.k, setup.v, block_size, gen)
            m = time_decode(setup, paged, eager=block_size == 16, steady=steady, gen=gen)
            del paged
            t = m.pop("time_us")
            rows.append(_row("paged_decode", batch, context, block_size, t, setup.baseline_us, nbytes,
                             baseline_variant=setup.baseline_variant, **_steady_columns(m, base, nbytes), **m))
            _print_progress(rows[-1])
        except Exception as e:  # noqa: BLE001
            rows.append({"kernel": "paged_decode", "batch": batch, "context": context, "block_size": block_size,
                         **errored("decode", (batch, context, block_size), e)})
    del setup
    torch.cuda.empty_cache()
    return rows


def bench_prefill_point(point, block_sizes, device, gen, steady: bool = True) -> list[dict]:
    batch, new_tokens, cached_tokens = point
    rows = []
    setup = prefill_setup(batch, new_tokens, cached_tokens, device)
    nbytes = prefill_bytes(batch, new_tokens, cached_tokens)
    flops = prefill_flops(batch, new_tokens, cached_tokens)
    base = None
    if steady:
        try:
            base = baseline_steady(setup, nbytes)
        except Exception as e:  # noqa: BLE001
            errored("sdpa steady", point, e)
    for block_size in block_sizes:
        try:
            m = time_prefill(setup, paged_copy(setup.k, setup.v, block_size, gen), steady=steady, gen=gen)
            t = m.pop("time_us")
            extra = {}
            if "steady_time_us" in m:
                extra["steady_tflops"] = round(flops / m["steady_time_us"] / 1e6, 2)
            if base is not None:
                extra["baseline_steady_tflops"] = round(flops / base[0] / 1e6, 2)
            rows.append(_row(
                "paged_prefill", batch, new_tokens + cached_tokens, block_size, t, setup.baseline_us, nbytes,
                baseline_variant=setup.baseline_variant, new_tokens=new_tokens, cached_tokens=cached_tokens,
                tflops=round(flops / t / 1e6, 2), baseline_tflops=round(flops / setup.baseline_us / 1e6, 2),
                **_steady_columns(m, base, nbytes), **extra, **m,
            ))
            _print_progress(rows[-1])
        except Exception as e:  # noqa: BLE001
            rows.append({"kernel": "paged_prefill", "batch": batch, "context": new_tokens + cached_tokens,
                         "block_size": block_size, "new_tokens": new_tokens, "cached_tokens": cached_tokens,
                         **errored("prefill", (point, block_size), e)})
    del setup
    torch.cuda.empty_cache()
    return rows


def _print_progress(row: dict) -> None:
    steady = ""
    if "steady_time_us" in row:
        steady = f" | steady {row['steady_time_us']:8.1f} us"
        if "baseline_steady_time_us" in row:
            steady += f" vs sdpa {row['baseline_steady_time_us']:8.1f} us"
    print(f"  {row['kernel']:13s} b={row['batch']:<4d} ctx={row['context']:<6d} bs={row['block_size']:<4d} "
          f"{row['time_us']:9.1f} us {row['tbps']:6.3f} TB/s | sdpa {row['baseline_time_us']:9.1f} us "
          f"{row['baseline_tbps']:6.3f} TB/s{steady} | err {row['rel_err']:.1e}", flush=True)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return dict(value.__dict__) if hasattr(value, "__dict__") else value


def metadata(command: str, notes: dict | None = None) -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = None
    meta = {
        "gpu": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "gpu_memory_bytes": props.total_memory,
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "shapes": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                   "dtype": str(DTYPE).removeprefix("torch."), "block_table": "random permutation of the blocks"},
        "timing": "time_us: one call captured in a CUDA graph, replays timed by triton.testing.do_bench (median, "
                  "CUDA events, L2 flushed before each call, warmup 10 ms, rep 50 ms); same for the baseline; "
                  "eager_time_us (block 16 rows): the decode call timed without a graph (adds Python/launch "
                  "overhead)",
        "steady_timing": f"steady_time_us: steady_calls (<= {STEADY_CALLS}) calls back to back in one CUDA graph, "
                         f"cycling over steady_sets input sets (own q, KV, block table, out) spanning >= "
                         f"{STEADY_MIN_BYTES / 1e6:.0f} MB of KV+q+out (at most {STEADY_MAX_SETS} sets); median "
                         "replay time (CUDA events) / steady_calls; baseline_steady_*: the same for SDPA",
        "launch_overrides": _jsonable(TUNED) or "none: the kernels' defaults (per-row tile/warps/stages/splits)",
        "bytes": "K and V read once + q read + out written (tbps = bytes / time)",
        "prefill_flops": "4 * head_dim * num_heads * attended (query, key) pairs under the causal mask",
        "baseline": "torch SDPA on contiguous [batch, kv_heads, context, head_dim] K/V, fastest variant "
                    "(baseline_variant), same run",
    }
    meta.update(notes or {})
    return meta


def print_table(df) -> None:
    """The target points: decode TB/s per block size against SDPA, and prefill TFLOP/s."""
    ok = df[df["time_us"].notna()] if "time_us" in df else df
    dec = ok[ok.kernel == "paged_decode"]
    print("\npaged_decode TB/s (per call) by block size; sdpa = contiguous baseline; steady = back to back")
    for (batch, context), g in dec.groupby(["batch", "context"]):
        if context != 4096 and not (batch in (1, 64, 128) and context in (2048, 16384)):
            continue
        cells = " ".join(f"{int(r.block_size)}:{r.tbps:.2f}" for r in g.itertuples())
        r0 = g.iloc[0]
        bs16 = g[g.block_size == 16]
        ours16 = f"{bs16.time_us.iloc[0]:.1f} us" if len(bs16) else "-"
        steady = ""
        if len(bs16) and "steady_time_us" in g and "baseline_steady_time_us" in g:
            s = bs16.iloc[0]
            steady = (f" | steady bs16 {s.steady_time_us:7.1f} us vs sdpa {s.baseline_steady_time_us:7.1f} us "
                      f"(x{s.baseline_steady_time_us / s.steady_time_us:.2f})")
        print(f"  b={batch:<4d} ctx={context:<6d} sdpa {r0.baseline_tbps:.2f} TB/s {r0.baseline_time_us:8.1f} us | "
              f"bs16 {ours16:>11s} | {cells}{steady}")
    pre = ok[ok.kernel == "paged_prefill"]
    if len(pre):
        print("\npaged_prefill TFLOP/s, ours vs SDPA causal (per call; steady in brackets)")
        for r in pre.itertuples():
            steady = ""
            if "steady_tflops" in pre and "baseline_steady_tflops" in pre:
                steady = f" [{r.steady_tflops:7.1f} vs {r.baseline_steady_tflops:7.1f}]"
            print(f"  b={r.batch:<3d} new={int(r.new_tokens):<5d} cached={int(r.cached_tokens):<5d} bs={r.block_size:<4d} "
                  f"{r.tflops:7.1f} vs {r.baseline_tflops:7.1f} ({r.baseline_variant}) ratio "
                  f"{r.baseline_time_us / r.time_us:.2f}{steady}")


def tidy(df):
    """Required columns first; integer extras stay integers where decode and prefill rows mix."""
    for c in COLUMNS:
        if c not in df:
            df[c] = None
    df = df[COLUMNS + [c for c in df.columns if c not in COLUMNS]].copy()
    for c in ("num_splits", "tile", "num_warps", "num_stages", "new_tokens", "cached_tokens", "block_m", "block_n",
              "steady_calls", "steady_sets"):
        if c in df:
            df[c] = df[c].astype("Int64")
    return df.sort_values(["kernel", "context", "batch", "block_size"], kind="stable").reset_index(drop=True)


def _work_order(decode_points, prefill_points):
    """Target points first (a time budget never drops them), then the rest in grid order."""
    first_d = [p for p in TARGET_DECODE if p in decode_points]
    first_p = [p for p in TARGET_PREFILL if p in prefill_points]
    work = [("decode", p) for p in first_d] + [("prefill", p) for p in first_p]
    work += [("decode", p) for p in decode_points if p not in first_d]
    work += [("prefill", p) for p in prefill_points if p not in first_p]
    return work


def run_kernel_bench(out_path=DEFAULT_OUT, quick: bool = False, command: str | None = None,
                     block_sizes=None, time_budget_s: float | None = None, steady: bool = True):
    """Measure the paged kernels on the current CUDA GPU; write the CSV and a metadata JSON beside it.

    Returns the rows as a pandas DataFrame. `quick` measures only the target points;
    `block_sizes` limits the block sizes; with `time_budget_s`, points (targets first) start
    only while the budget lasts, and the ones left out are listed in the metadata.
    """
    import pandas as pd

    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    torch.manual_seed(0)
    batches, contexts, points = (QUICK_BATCHES, QUICK_CONTEXTS, QUICK_PREFILL_POINTS) if quick else (
        BATCHES, CONTEXTS, PREFILL_POINTS)
    block_sizes = tuple(block_sizes or BLOCK_SIZES)
    decode_points = [(b, c) for c in contexts for b in batches if decode_bytes(b, c) <= MAX_KV_BYTES]
    budget = Budget(time_budget_s)
    rows, skipped = [], []
    for kind, point in _work_order(decode_points, list(points)):
        if budget.left() <= 0:
            skipped.append([kind, *point])
            continue
        try:
            if kind == "decode":
                rows += bench_decode_point(*point, block_sizes, device, gen, steady=steady)
            else:
                rows += bench_prefill_point(point, block_sizes, device, gen, steady=steady)
        except Exception as e:  # noqa: BLE001 - e.g. the SDPA setup ran out of memory
            rows.append({"kernel": "paged_" + kind, "batch": point[0], "context": sum(point[1:]),
                         **errored(kind, point, e)})
    df = tidy(pd.DataFrame(rows))
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out_path, index=False)
    command = command or "python -m simkv.gpu.bench kernels --out " + str(out_path) + (" --quick" if quick else "")
    notes = {"block_sizes": list(block_sizes)}
    if skipped:
        notes["not_measured_time_budget"] = skipped
    out_path.with_suffix(".json").write_text(json.dumps(metadata(command, notes), indent=2) + "\n")
    print_table(df)
    if skipped:
        print(f"\nleft out for the time budget: {skipped}")
    return df


WINDOW_PREFILL_POINT = (4, 4096, 4096)    # (batch, new tokens, cached tokens)


def run_window_bench(out_path, batch: int = 64, context: int = 32768, windows=(1024,), block_sizes=(16,),
                     command: str | None = None):
    """Window rows (see the module docstring) on the current CUDA GPU; writes the CSV and a
    metadata JSON beside it and returns the rows as a DataFrame."""
    import pandas as pd

    from simkv.gpu.kernel_measure import measure_window_decode, measure_window_prefill, random_paged, window_kv_bytes

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for block_size in block_sizes:
        q, paged = random_paged(batch, context, block_size, device, gen)
        full_bytes = window_kv_bytes(batch, context, None)
        full = measure_window_decode(q, paged, None)
        for window in (None, *windows):
            m = full if window is None else measure_window_decode(q, paged, window)
            rows.append({
                "kernel": "paged_decode", "batch": batch, "context": context, "block_size": block_size,
                "window": window, "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                "dtype": str(DTYPE).removeprefix("torch."), "time_us": round(m["time_us"], 3),
                "tbps": round(m["block_bytes_loaded"] / m["time_us"] / 1e6, 4),
                "blocks_loaded": m["blocks_loaded"], "block_bytes_loaded": m["block_bytes_loaded"],
                "kv_bytes_loaded": m["kv_bytes_loaded"], "full_kv_bytes": full_bytes,
                "loaded_fraction": round(m["block_bytes_loaded"] / full_bytes, 6),
                "full_time_us": round(full["time_us"], 3), "time_ratio": round(m["time_us"] / full["time_us"], 4),
                "rel_err": m["rel_err"],
            })
        del q, paged
        torch.cuda.empty_cache()
        pb, new, cached = WINDOW_PREFILL_POINT
        full_p = measure_window_prefill(pb, new, cached, block_size, None, device, gen)
        for window in (None, *windows):
            m = full_p if window is None else measure_window_prefill(pb, new, cached, block_size, window, device, gen)
            rows.append({
                "kernel": "paged_prefill", "batch": pb, "context": new + cached, "block_size": block_size,
                "window": window, "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                "dtype": str(DTYPE).removeprefix("torch."), "new_tokens": new, "cached_tokens": cached,
                "time_us": round(m["time_us"], 3), "full_time_us": round(full_p["time_us"], 3),
                "time_ratio": round(m["time_us"] / full_p["time_us"], 4), "rel_err": m["rel_err"],
            })
        torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    for c in ("window", "blocks_loaded", "block_bytes_loaded", "kv_bytes_loaded", "full_kv_bytes", "new_tokens",
              "cached_tokens"):
        if c in df:
            df[c] = df[c].astype("Int64")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out_path, index=False)
    command = command or f"python -m simkv.gpu.bench window --out {out_path}"
    notes = {"timing": "time_us: one call captured in a CUDA graph, replays timed by triton.testing.do_bench "
             "(median, CUDA events, L2 flushed before each call, warmup 10 ms, rep 50 ms); full_time_us: the same "
             "for the launch without a window", "steady_timing": "not measured for window rows",
             "baseline": "none: the same kernel over the full context (full_time_us)",
             "bytes": "tbps = block_bytes_loaded / time_us (decode rows)",
             "window_rows": "blocks_loaded: K pages read per launch, summed over sequences and KV heads, counted "
             "by the kernel (load_counts); V reads the same pages. loaded_fraction = block_bytes_loaded / "
             "full_kv_bytes (K and V of every token of every sequence). time_us: one call in a CUDA graph, "
             "do_bench median, L2 flushed; full_time_us: the same launch without a window. rel_err: against "
             "simkv.gpu.reference on the first sequences (decode 2, prefill 1)"}
    out_path.with_suffix(".json").write_text(json.dumps(metadata(command, notes), indent=2) + "\n")
    for r in df.itertuples():
        frac = f" loads {r.loaded_fraction:.4f} of full KV ({r.blocks_loaded} pages)" if r.kernel == "paged_decode" else ""
        print(f"  {r.kernel:13s} b={r.batch} ctx={r.context} bs={r.block_size} window={r.window}: "
              f"{r.time_us:9.1f} us, x{r.time_ratio:.3f} of full{frac}, err {r.rel_err:.1e}", flush=True)
    return df


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simkv.gpu.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels", help="benchmark the paged kernels against SDPA; write CSV + JSON")
    k.add_argument("--out", default=DEFAULT_OUT)
    k.add_argument("--quick", action="store_true", help="only the target points")
    k.add_argument("--configs", help="launch parameters from `tune` (its best.json) instead of the defaults")
    k.add_argument("--block-sizes", type=_sizes, help="comma-separated block sizes (default: all)")
    k.add_argument("--time-budget-s", type=float, help="start no new point after this many seconds "
                   "(target points run first)")
    k.add_argument("--no-steady", action="store_true", help="per-call timing only")
    t = sub.add_parser("tune", help="sweep launch parameters at the target points")
    t.add_argument("--out", default="kernel_tune", help="directory for tune.csv and best.json")
    t.add_argument("--quick", action="store_true", help="decode split policy at batch 1/4/8 and the prefill "
                   "sweep at 8 x 2048 only; budget 170 s unless --time-budget-s")
    t.add_argument("--time-budget-s", type=float, help="start no new measurement after this many seconds")
    t.add_argument("--configs", help="start from the launch parameters of an earlier best.json")
    w = sub.add_parser("window", help="sliding-window decode/prefill against full context; pages read")
    w.add_argument("--out", default="profiles/h200/kernels-window/window.csv")
    w.add_argument("--batch", type=int, default=64)
    w.add_argument("--context", type=int, default=32768)
    w.add_argument("--windows", type=_sizes, default=(1024,))
    w.add_argument("--block-sizes", type=_sizes, default=(16,))
    args = parser.parse_args(argv)
    command = "python -m simkv.gpu.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    if getattr(args, "configs", None):
        load_tuned(args.configs)
    if args.what == "window":
        run_window_bench(args.out, args.batch, args.context, args.windows, args.block_sizes, command=command)
    elif args.what == "kernels":
        run_kernel_bench(args.out, quick=args.quick, command=command, block_sizes=args.block_sizes,
                         time_budget_s=args.time_budget_s, steady=not args.no_steady)
    else:
        budget = args.time_budget_s if args.time_budget_s is not None else (170.0 if args.quick else None)
        run_tune(args.out, quick=args.quick, time_budget_s=budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
