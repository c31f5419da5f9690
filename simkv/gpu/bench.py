"""Kernel benchmark: the paged kernels against torch SDPA on contiguous KV, on one CUDA GPU.

    python -m simkv.gpu.bench kernels [--out profiles/h200/kernels.csv] [--quick]
    python -m simkv.gpu.bench tune [--out tune.csv]        # launch-parameter sweep at the targets

`kernels` writes one CSV row per (kernel, batch, context, block size) with the columns of
`COLUMNS` (then extra columns), a metadata JSON beside it (GPU, driver, versions, date, command),
and prints the target points. Shapes: 32 query heads, 8 KV heads, head_dim 128, bfloat16; the
block table is a random permutation of the cache's blocks. Bytes counted per call: K and V read
once, q read and out written once. Times are medians of `triton.testing.do_bench` (CUDA events,
L2 flushed before each call) after its warm-up. The baseline is torch SDPA over contiguous
[batch, kv_heads, context, head_dim] K/V of the same shape in the same run; of the ways to call
it (decode: query heads folded into the query length, or `enable_gqa`; prefill: `enable_gqa`, or
K/V expanded to all heads) the fastest is kept and named in `baseline_variant`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

COLUMNS = [
    "kernel", "batch", "context", "block_size", "num_heads", "num_kv_heads", "head_dim", "dtype",
    "time_us", "tbps", "baseline", "baseline_time_us", "baseline_tbps",
]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (512, 2048, 4096, 16384)
BLOCK_SIZES = (8, 16, 32, 64, 128)
# (batch, new tokens per sequence, cached prefix tokens per sequence)
PREFILL_POINTS = ((1, 2048, 0), (8, 512, 0), (8, 2048, 0), (32, 512, 0), (4, 4096, 0),
                  (1, 2048, 2048), (8, 512, 2048), (8, 2048, 2048))
QUICK_BATCHES, QUICK_CONTEXTS = (1, 64, 128), (4096,)
QUICK_PREFILL_POINTS = ((8, 2048, 0), (8, 2048, 2048))
MAX_KV_BYTES = 40e9
DEFAULT_OUT = "profiles/h200/kernels.csv"
# Launch-parameter overrides from `tune` (--configs); empty: the kernels' own defaults.
TUNED: dict = {}


def time_us(fn, graph: bool = True) -> float:
    """Median time of one fn() call in microseconds.

    With `graph`, the call is captured once in a CUDA graph and the replays are timed, so the
    number is device time without Python/launch overhead (as in an engine that replays graphs).
    triton.testing.do_bench times each call with CUDA events and flushes the L2 cache before it.
    """
    import triton.testing

    run = fn
    if graph:
        fn()
        torch.cuda.synchronize()
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        except RuntimeError as e:  # not capturable: time it eagerly rather than not at all
            print(f"  graph capture failed, timing eagerly: {str(e).splitlines()[0][:100]}", file=sys.stderr)
            torch.cuda.synchronize()
    return triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median") * 1e3


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _fastest(variants: dict) -> tuple[float, str, torch.Tensor]:
    """Time each callable that runs; return (time_us, name, output) of the fastest."""
    best = None
    for name, fn in variants.items():
        try:
            result = fn()
            t = time_us(fn)
        except RuntimeError as e:  # a backend that refuses this shape
            print(f"  sdpa variant {name} failed: {str(e).splitlines()[0][:120]}", file=sys.stderr)
            continue
        if best is None or t < best[0]:
            best = (t, name, result)
    if best is None:
        raise RuntimeError("no SDPA variant ran")
    return best


@dataclass
class Contiguous:
    """Contiguous q/K/V of one benchmark point, the SDPA baseline's time and output."""

    q: torch.Tensor  # decode [B, H, D]; prefill [B, H, new, D]
    k: torch.Tensor  # [B, KVH, context, D]
    v: torch.Tensor
    baseline_us: float
    baseline_variant: str
    expected: torch.Tensor  # in the kernel's q layout


def decode_setup(batch: int, context: int, device) -> Contiguous:
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=device, dtype=DTYPE)
    v = torch.randn_like(k)
    group = NUM_HEADS // NUM_KV_HEADS
    q_grouped = q.view(batch, NUM_KV_HEADS, group, HEAD_DIM)
    t, name, out = _fastest({
        "heads_as_queries": lambda: F.scaled_dot_product_attention(q_grouped, k, v),
        "enable_gqa": lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True),
    })
    return Contiguous(q, k, v, t, name, out.reshape(batch, NUM_HEADS, HEAD_DIM))


def prefill_setup(batch: int, new_tokens: int, cached_tokens: int, device) -> Contiguous:
    from torch.nn.attention.bias import causal_lower_right

    context = new_tokens + cached_tokens
    q = torch.randn(batch, NUM_HEADS, new_tokens, HEAD_DIM, device=device, dtype=DTYPE)
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device=device, dtype=DTYPE)
    v = torch.randn_like(k)
    group = NUM_HEADS // NUM_KV_HEADS
    k_all, v_all = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    if cached_tokens == 0:
        variants = {
            "enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "expanded_kv": lambda: F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True),
        }
    else:
        mask = causal_lower_right(new_tokens, context)
        variants = {
            "enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
            "expanded_kv": lambda: F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask),
        }
    t, name, out = _fastest(variants)
    del k_all, v_all
    expected = out.transpose(1, 2).reshape(batch * new_tokens, NUM_HEADS, HEAD_DIM)
    return Contiguous(q, k, v, t, name, expected)


def paged_copy(k: torch.Tensor, v: torch.Tensor, block_size: int, gen: torch.Generator):
    """The contiguous K/V scattered into a paged cache through a shuffled block table."""
    batch, _, context, _ = k.shape
    per_seq = context // block_size
    num_blocks = batch * per_seq
    table = torch.randperm(num_blocks, device=k.device, generator=gen).view(batch, per_seq)
    caches = []
    for x in (k, v):
        cache = torch.empty(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, device=k.device, dtype=x.dtype)
        cache[table.reshape(-1)] = x.transpose(1, 2).reshape(num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        caches.append(cache)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=k.device)
    return caches[0], caches[1], table.to(torch.int32), seq_lens


def decode_bytes(batch: int, context: int) -> int:
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM
    return (kv + 2 * batch * NUM_HEADS * HEAD_DIM) * DTYPE.itemsize


def prefill_bytes(batch: int, new_tokens: int, cached_tokens: int) -> int:
    kv = 2 * batch * (new_tokens + cached_tokens) * NUM_KV_HEADS * HEAD_DIM
    return (kv + 2 * batch * new_tokens * NUM_HEADS * HEAD_DIM) * DTYPE.itemsize


def prefill_flops(batch: int, new_tokens: int, cached_tokens: int) -> float:
    """2 matmuls × 2 flops per multiply-add over the (query, key) pairs the causal mask keeps."""
    pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
    return 4.0 * HEAD_DIM * NUM_HEADS * batch * pairs


def time_decode(setup: Contiguous, paged, config=None, num_splits=None, eager: bool = False) -> dict:
    from simkv.gpu.kernels import decode_config, decode_num_splits, decode_workspace_numel, paged_decode_attention
    from simkv.gpu.kernels._common import sm_count

    k_cache, v_cache, table, seq_lens = paged
    batch, block_size = setup.q.shape[0], k_cache.shape[1]
    cfg = config or TUNED.get("decode_configs", {}).get(block_size) or decode_config(block_size, HEAD_DIM, DTYPE)
    if num_splits is None:
        num_splits = decode_num_splits(
            batch, NUM_KV_HEADS, table.shape[1] * block_size, cfg.tile, sm_count(setup.q.device),
            split_programs_per_sm=TUNED.get("split_programs_per_sm"), min_tiles_per_split=TUNED.get("min_tiles_per_split"))
    out = torch.empty_like(setup.q)
    workspace = torch.empty(decode_workspace_numel(batch, NUM_HEADS, HEAD_DIM, num_splits), device=setup.q.device)

    def call():
        return paged_decode_attention(setup.q, k_cache, v_cache, table, seq_lens, out=out, workspace=workspace,
                                      num_splits=num_splits, config=cfg)

    err = rel_err(call(), setup.expected)
    result = {"time_us": time_us(call), "num_splits": num_splits, "tile": cfg.tile, "num_warps": cfg.num_warps,
              "num_stages": cfg.num_stages, "rel_err": err}
    if eager:
        result["eager_time_us"] = round(time_us(call, graph=False), 3)
    return result


def time_prefill(setup: Contiguous, paged, config=None) -> dict:
    from simkv.gpu.kernels import paged_prefill_attention, prefill_config

    k_cache, v_cache, table, seq_lens = paged
    batch, _, new_tokens, _ = setup.q.shape
    cfg = config or TUNED.get("prefill_config") or prefill_config(HEAD_DIM, DTYPE)
    q = setup.q.transpose(1, 2).reshape(batch * new_tokens, NUM_HEADS, HEAD_DIM)
    starts = torch.arange(0, batch + 1, device=q.device, dtype=torch.int32) * new_tokens
    out = torch.empty_like(q)

    def call():
        return paged_prefill_attention(q, k_cache, v_cache, table, starts, seq_lens, out=out, config=cfg)

    err = rel_err(call(), setup.expected)
    t = time_us(call)
    return {"time_us": t, "block_m": cfg.block_m, "block_n": cfg.block_n, "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages, "rel_err": err}


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


def bench_decode(batches, contexts, block_sizes, device, gen) -> list[dict]:
    rows = []
    for context in contexts:
        for batch in batches:
            if decode_bytes(batch, context) > MAX_KV_BYTES:
                continue
            setup = decode_setup(batch, context, device)
            nbytes = decode_bytes(batch, context)
            for block_size in block_sizes:
                paged = paged_copy(setup.k, setup.v, block_size, gen)
                m = time_decode(setup, paged, eager=block_size == 16)
                del paged
                rows.append(_row("paged_decode", batch, context, block_size, m.pop("time_us"), setup.baseline_us,
                                 nbytes, baseline_variant=setup.baseline_variant, **m))
                _print_progress(rows[-1])
            del setup
            torch.cuda.empty_cache()
    return rows


def bench_prefill(points, block_sizes, device, gen) -> list[dict]:
    rows = []
    for batch, new_tokens, cached_tokens in points:
        setup = prefill_setup(batch, new_tokens, cached_tokens, device)
        nbytes = prefill_bytes(batch, new_tokens, cached_tokens)
        flops = prefill_flops(batch, new_tokens, cached_tokens)
        for block_size in block_sizes:
            m = time_prefill(setup, paged_copy(setup.k, setup.v, block_size, gen))
            t = m.pop("time_us")
            rows.append(_row(
                "paged_prefill", batch, new_tokens + cached_tokens, block_size, t, setup.baseline_us, nbytes,
                baseline_variant=setup.baseline_variant, new_tokens=new_tokens, cached_tokens=cached_tokens,
                tflops=round(flops / t / 1e6, 2), baseline_tflops=round(flops / setup.baseline_us / 1e6, 2), **m,
            ))
            _print_progress(rows[-1])
        del setup
        torch.cuda.empty_cache()
    return rows


def _print_progress(row: dict) -> None:
    print(f"  {row['kernel']:13s} b={row['batch']:<4d} ctx={row['context']:<6d} bs={row['block_size']:<4d} "
          f"{row['time_us']:9.1f} us {row['tbps']:6.3f} TB/s | sdpa {row['baseline_time_us']:9.1f} us "
          f"{row['baseline_tbps']:6.3f} TB/s | err {row['rel_err']:.1e}", flush=True)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return dict(value.__dict__) if hasattr(value, "__dict__") else value


def metadata(command: str) -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        driver = None
    return {
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
        "timing": "one call captured in a CUDA graph, replays timed by triton.testing.do_bench (median, CUDA "
                  "events, L2 flushed before each call, warmup 10 ms, rep 50 ms); same for the baseline; "
                  "eager_time_us (block 16 rows): the decode call timed without a graph (adds Python/launch overhead)",
        "launch_overrides": _jsonable(TUNED) or "none: the kernels' defaults (per-row tile/warps/stages/splits)",
        "bytes": "K and V read once + q read + out written (tbps = bytes / time)",
        "prefill_flops": "4 * head_dim * num_heads * attended (query, key) pairs under the causal mask",
        "baseline": "torch SDPA on contiguous [batch, kv_heads, context, head_dim] K/V, fastest variant "
                    "(baseline_variant), same run",
    }


def print_table(df) -> None:
    """The target points: decode TB/s per block size against SDPA, and prefill TFLOP/s."""
    dec = df[df.kernel == "paged_decode"]
    print("\npaged_decode TB/s (incl. merge) by block size; sdpa = contiguous baseline")
    for (batch, context), g in dec.groupby(["batch", "context"]):
        if context != 4096 and not (batch in (1, 64, 128) and context in (2048, 16384)):
            continue
        cells = " ".join(f"{int(r.block_size)}:{r.tbps:.2f}" for r in g.itertuples())
        r0 = g.iloc[0]
        bs16 = g[g.block_size == 16]
        ours16 = f"{bs16.time_us.iloc[0]:.1f} us" if len(bs16) else "-"
        print(f"  b={batch:<4d} ctx={context:<6d} sdpa {r0.baseline_tbps:.2f} TB/s {r0.baseline_time_us:8.1f} us | "
              f"bs16 {ours16:>11s} | {cells}")
    pre = df[df.kernel == "paged_prefill"]
    if len(pre):
        print("\npaged_prefill TFLOP/s, ours vs SDPA causal")
        for r in pre.itertuples():
            print(f"  b={r.batch:<3d} new={int(r.new_tokens):<5d} cached={int(r.cached_tokens):<5d} bs={r.block_size:<4d} "
                  f"{r.tflops:7.1f} vs {r.baseline_tflops:7.1f} ({r.baseline_variant}) ratio {r.baseline_time_us / r.time_us:.2f}")


def tidy(df):
    """Required columns first; integer extras stay integers where decode and prefill rows mix."""
    df = df[COLUMNS + [c for c in df.columns if c not in COLUMNS]].copy()
    for c in ("num_splits", "tile", "num_warps", "num_stages", "new_tokens", "cached_tokens", "block_m", "block_n"):
        if c in df:
            df[c] = df[c].astype("Int64")
    return df


def run_kernel_bench(out_path=DEFAULT_OUT, quick: bool = False, command: str | None = None):
    """Measure the paged kernels on the current CUDA GPU; write the CSV and a metadata JSON beside it.

    Returns the rows as a pandas DataFrame. `quick` measures only the target points.
    """
    import pandas as pd

    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    torch.manual_seed(0)
    batches, contexts, points = (QUICK_BATCHES, QUICK_CONTEXTS, QUICK_PREFILL_POINTS) if quick else (
        BATCHES, CONTEXTS, PREFILL_POINTS)
    rows = bench_decode(batches, contexts, BLOCK_SIZES, device, gen)
    rows += bench_prefill(points, BLOCK_SIZES, device, gen)
    df = pd.DataFrame(rows)
    df = tidy(df)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out_path, index=False)
    command = command or "python -m simkv.gpu.bench kernels --out " + str(out_path) + (" --quick" if quick else "")
    out_path.with_suffix(".json").write_text(json.dumps(metadata(command), indent=2) + "\n")
    print_table(df)
    return df


def run_tune(out_path, context: int = 4096, prefill_tokens: int = 2048, device="cuda") -> dict:
    """Sweep launch parameters at the target points; write every measurement to `out_path` and
    the best choices to `<out_path stem>.best.json` (the `kernels --configs` format); return them."""
    import pandas as pd

    from simkv.gpu.kernels import DecodeConfig, PrefillConfig, decode_num_splits
    from simkv.gpu.kernels._common import sm_count

    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []

    def record(kind, batch, ctx, block_size, m, setup, nbytes, **extra):
        t = m.pop("time_us")
        rows.append({"kind": kind, "batch": batch, "context": ctx, "block_size": block_size,
                     "time_us": round(t, 2), "tbps": round(nbytes / t / 1e6, 3), "sdpa_us": round(setup.baseline_us, 2),
                     "vs_sdpa": round(setup.baseline_us / t, 3), **m, **extra})
        print(f"  {kind} b={batch} ctx={ctx} bs={block_size} {m} {extra} -> {t:.1f} us "
              f"{rows[-1]['tbps']} TB/s (sdpa {setup.baseline_us:.1f} us, x{rows[-1]['vs_sdpa']})", flush=True)
        return t

    def try_decode(setup, paged, cfg, **kw):
        try:
            return time_decode(setup, paged, cfg, **kw)
        except Exception as e:  # e.g. out of shared memory
            print(f"  decode {cfg} failed: {str(e).splitlines()[0][:100]}")
            return None

    # 1. kernel configuration per block size at the main target (batch 64, unsplit there)
    decode_configs = [DecodeConfig(*c) for c in ((32, 4, 2), (32, 4, 3), (32, 4, 4), (64, 4, 2), (64, 4, 3),
                                                 (128, 4, 2))]
    best_decode = {}
    setup = decode_setup(64, context, device)
    for block_size in BLOCK_SIZES:
        paged = paged_copy(setup.k, setup.v, block_size, gen)
        times = {}
        for cfg in decode_configs:
            m = try_decode(setup, paged, cfg)
            if m is not None:
                times[cfg] = record("decode_config", 64, context, block_size, m, setup, decode_bytes(64, context))
        best_decode[block_size] = min(times, key=times.get)
        del paged
    del setup
    torch.cuda.empty_cache()

    # 2. split policy for small batches, with the chosen configurations
    policies = ((2, 2), (4, 2), (4, 1), (8, 1))  # (split programs per SM, min tiles per split)
    cost = {p: 0.0 for p in policies}
    for batch in (1, 8, 32):
        setup = decode_setup(batch, context, device)
        paged = paged_copy(setup.k, setup.v, 16, gen)
        cfg = best_decode[16]
        for per_sm, min_tiles in policies:
            splits = decode_num_splits(batch, NUM_KV_HEADS, context, cfg.tile, sm_count(device),
                                       split_programs_per_sm=per_sm, min_tiles_per_split=min_tiles)
            m = time_decode(setup, paged, cfg, splits)
            cost[(per_sm, min_tiles)] += record("decode_splits", batch, context, 16, m, setup, decode_bytes(batch, context),
                                                split_programs_per_sm=per_sm, min_tiles_per_split=min_tiles) / setup.baseline_us
        del paged, setup
        torch.cuda.empty_cache()
    best_policy = min(cost, key=cost.get)

    # 3. prefill configuration
    prefill_configs = [PrefillConfig(*c) for c in ((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3))]
    pcost = {}
    for batch, new_tokens, cached in ((8, prefill_tokens, 0), (8, prefill_tokens // 4, prefill_tokens)):
        setup = prefill_setup(batch, new_tokens, cached, device)
        paged = paged_copy(setup.k, setup.v, 16, gen)
        flops = prefill_flops(batch, new_tokens, cached)
        for cfg in prefill_configs:
            try:
                m = time_prefill(setup, paged, cfg)
            except Exception as e:
                print(f"  prefill {cfg} failed: {str(e).splitlines()[0][:100]}")
                pcost[cfg] = float("inf")
                continue
            t = record("prefill_config", batch, new_tokens + cached, 16, m, setup, prefill_bytes(batch, new_tokens, cached),
                       tflops=round(flops / m["time_us"] / 1e6, 1), sdpa_tflops=round(flops / setup.baseline_us / 1e6, 1),
                       sdpa_variant=setup.baseline_variant)
            pcost[cfg] = pcost.get(cfg, 0.0) + t / setup.baseline_us
        del paged, setup
        torch.cuda.empty_cache()

    best = {"decode_configs": {str(b): list(c.__dict__.values()) for b, c in best_decode.items()},
            "split_programs_per_sm": best_policy[0], "min_tiles_per_split": best_policy[1],
            "prefill_config": list(min(pcost, key=pcost.get).__dict__.values())}
    pd.DataFrame(rows).to_csv(out_path, index=False)
    Path(out_path).with_suffix(".best.json").write_text(json.dumps(best, indent=2) + "\n")
    print("best:", json.dumps(best))
    return best


def load_tuned(path) -> None:
    """Use the launch parameters of a `tune` result (JSON) in this process's measurements."""
    from simkv.gpu.kernels import DecodeConfig, PrefillConfig

    best = json.loads(Path(path).read_text())
    TUNED.clear()
    TUNED["decode_configs"] = {int(b): DecodeConfig(*c) for b, c in best["decode_configs"].items()}
    TUNED["prefill_config"] = PrefillConfig(*best["prefill_config"])
    TUNED["split_programs_per_sm"] = best["split_programs_per_sm"]
    TUNED["min_tiles_per_split"] = best["min_tiles_per_split"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simkv.gpu.bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kernels", help="benchmark the paged kernels against SDPA; write CSV + JSON")
    k.add_argument("--out", default=DEFAULT_OUT)
    k.add_argument("--quick", action="store_true", help="only the target points")
    k.add_argument("--configs", help="launch parameters from `tune` (its .best.json) instead of the defaults")
    t = sub.add_parser("tune", help="sweep launch parameters at the target points")
    t.add_argument("--out", default="kernel_tune.csv")
    args = parser.parse_args(argv)
    command = "python -m simkv.gpu.bench " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.what == "kernels":
        if args.configs:
            load_tuned(args.configs)
        run_kernel_bench(args.out, quick=args.quick, command=command)
    else:
        run_tune(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
