"""The MoE sample model's decode step on one CUDA GPU against its bytes floor.

    python3 scripts/moe_device/moe_step.py --out DIR [--model qwen3-30b-a3b] [--batch 64]
                                           [--context 2048] [--block-size 16]

Writes DIR/moe_step.json (and prints a table):

* HBM bandwidth, measured: a Triton kernel that only reads (8 GiB of bf16, each program sums its
  slice) and torch's device-to-device copy (bytes read + written), do_bench medians.
* The grouped expert GEMMs (`simkv.gpu.moe.fused_moe`) on one layer's real weights at the step's
  batch: rel_err against the expert-by-expert loop in float32, time (CUDA graph) against the
  touched experts' bytes over the read bandwidth, a few launch configurations, and torch's
  grouped matmul (torch._grouped_mm) on the same pairs where it runs.
* The decode step: the model's forward over `batch` sequences of `context` tokens (paged KV, random
  weights and K/V built on the GPU) plus greedy sampling, captured in one CUDA graph, replays timed
  with CUDA events (median); its bytes floor = weights the step reads (every non-expert matrix,
  the LM head, the embedding rows of the batch, the experts the routing touched in each layer,
  counted from an eager forward of the same inputs) + K/V read, over the read bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

from simkv.gpu import model as model_mod
from simkv.gpu import moe
from simkv.gpu.attention import AttentionMetadata
from simkv.gpu.bench import metadata
from simkv.gpu.model import LlamaModel
from simkv.specs import load_model


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def bandwidth(gib: float = 8.0) -> dict:
    """Read-only and copy bandwidth in bytes/s (do_bench medians)."""
    n = int(gib * 2**30) // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    block, iters = 4096, 8
    programs = triton.cdiv(n, block * iters)
    out = torch.empty(programs, device="cuda", dtype=torch.float32)
    read_ms = triton.testing.do_bench(lambda: _read_kernel[(programs,)](x, out, n, BLOCK=block, ITERS=iters,
                                                                        num_warps=8), warmup=20, rep=200,
                                      return_mode="median")
    y = torch.empty_like(x)
    copy_ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
    nbytes = n * 2
    del x, y
    torch.cuda.empty_cache()
    return {"read_bytes_per_s": nbytes / (read_ms / 1e3), "copy_bytes_per_s": 2 * nbytes / (copy_ms / 1e3),
            "bytes": nbytes}


GRAPHED: dict = {}   # id of a timed function -> whether it ran as a CUDA graph


def graph_time_us(fn, reps: int = 30) -> float:
    """Median replay time (µs) of fn captured in a CUDA graph, CUDA events around each replay
    (fn itself, eagerly, where it cannot be captured: GRAPHED says which)."""
    fn()
    torch.cuda.synchronize()
    run = fn
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    except RuntimeError as e:
        print(f"  graph capture failed, timing eagerly: {str(e).splitlines()[0][:150]}", file=sys.stderr)
        torch.cuda.synchronize()
    GRAPHED[id(fn)] = run is not fn
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps + 3):
        start.record()
        run()
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def expert_bytes(layer) -> int:
    return layer.gate_up[0].numel() * layer.gate_up.element_size() + layer.down[0].numel() * layer.down.element_size()


def grouped_mm_torch(h, w_gate_up, w_down, weights, ids):
    """The same experts through torch._grouped_mm: pairs sorted by expert, two grouped matmuls."""
    num_tokens, top_k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w_gate_up.shape[0], dtype=torch.int32, device=h.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0).to(torch.int32)
    a = h[order // top_k]
    gu = torch._grouped_mm(a, w_gate_up.transpose(1, 2), offs=offs)
    inter = w_down.shape[2]
    act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    down = torch._grouped_mm(act, w_down.transpose(1, 2), offs=offs)
    out = torch.zeros(num_tokens * top_k, h.shape[1], dtype=torch.float32, device=h.device)
    out[order] = down.float() * weights.reshape(-1)[order, None]
    return out.view(num_tokens, top_k, -1).sum(1).to(h.dtype)


def moe_layer(model, batch: int, read_bw: float) -> dict:
    """fused_moe on layer 0's experts at `batch` tokens: error, time, touched bytes, configs."""
    layer = model.layers[0]
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(batch, model.hidden_size, device="cuda", dtype=model.dtype, generator=gen)
    weights, ids = moe.route(h, layer.router, model.router_cfg)
    out = moe.fused_moe(h, layer.gate_up, layer.down, weights, ids)
    ref = moe.reference_moe(h.float(), layer.gate_up, layer.down, weights, ids)
    touched = moe.touched_experts(ids, model.router_cfg.num_experts)
    floor_us = touched * expert_bytes(layer) / read_bw * 1e6
    result = {"batch": batch, "touched_experts": touched, "touched_bytes": touched * expert_bytes(layer),
              "rel_err": ((out.float() - ref.float()).norm() / ref.float().norm()).item(),
              "floor_us": floor_us, "configs": []}
    default = moe.moe_config(ids.numel(), model.router_cfg.num_experts, model.dtype)
    candidates = [default] + [moe.MoeConfig(16, bn, bk, w, st) for bn, bk, w, st in
                              ((64, 64, 4, 4), (128, 64, 4, 3), (64, 256, 4, 3), (32, 128, 4, 4), (128, 128, 8, 3))]
    for cfg in candidates:
        try:
            t = graph_time_us(lambda cfg=cfg: moe.fused_moe(h, layer.gate_up, layer.down, weights, ids, cfg))
            result["configs"].append({**cfg.__dict__, "time_us": t, "x_floor": t / floor_us})
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile or fit
            result["configs"].append({**cfg.__dict__, "error": f"{type(e).__name__}: {str(e)[:150]}"})
    result["default_time_us"] = result["configs"][0].get("time_us")
    try:
        got = grouped_mm_torch(h, layer.gate_up, layer.down, weights, ids)
        t = graph_time_us(lambda: grouped_mm_torch(h, layer.gate_up, layer.down, weights, ids))
        result["torch_grouped_mm"] = {"time_us": t, "x_floor": t / floor_us,
                                      "rel_err": ((got.float() - ref.float()).norm() / ref.float().norm()).item()}
    except Exception as e:  # noqa: BLE001
        result["torch_grouped_mm"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return result


def decode_inputs(model, batch: int, context: int, block_size: int):
    """Token ids, positions, metadata and a random paged KV cache for one decode step."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    per_seq = context // block_size
    num_blocks = batch * per_seq + 1
    caches = model.allocate_kv_cache(num_blocks, block_size)
    for layer in range(caches.shape[0]):
        caches[layer].normal_(generator=gen)
    table = (torch.randperm(batch * per_seq, device="cuda", generator=gen) + 1).view(batch, per_seq)
    table = table.to(torch.int32)
    pos = context - 1
    slots = (table[:, pos // block_size].long() * block_size + pos % block_size)
    from simkv.gpu.kernels import decode_config, decode_num_splits, decode_workspace_numel
    from simkv.gpu.kernels._common import sm_count
    cfg = decode_config(block_size, model.head_dim, model.dtype)
    splits = decode_num_splits(batch, model.num_kv_heads, per_seq * block_size, cfg.tile, sm_count(caches.device))
    workspace = torch.empty(decode_workspace_numel(batch, model.num_heads, model.head_dim, splits),
                            device="cuda", dtype=torch.float32)
    meta = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=0, decode_block_tables=table,
                             decode_seq_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
                             decode_workspace=workspace)
    input_ids = torch.randint(0, model.spec.vocab_size, (batch,), device="cuda", generator=gen)
    positions = torch.full((batch,), pos, dtype=torch.int64, device="cuda")
    return input_ids, positions, meta, caches


def decode_step(model, batch: int, context: int, block_size: int, read_bw: float) -> dict:
    input_ids, positions, meta, caches = decode_inputs(model, batch, context, block_size)
    touched = []
    route = model_mod.fused_route

    def recording_route(h, router, cfg):
        weights, ids = route(h, router, cfg)
        touched.append(moe.touched_experts(ids, cfg.num_experts))
        return weights, ids

    model_mod.fused_route = recording_route
    try:
        logits = model.forward(input_ids, positions, meta, caches)
    finally:
        model_mod.fused_route = route
    torch.cuda.synchronize()
    step = lambda: model.forward(input_ids, positions, meta, caches).argmax(-1)  # noqa: E731
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    eager_us = (time.perf_counter() - t0) * 1e6
    graph_us = graph_time_us(step)
    graphed = GRAPHED[id(step)]
    try:
        profile = kernel_profile(step)
    except Exception as e:  # noqa: BLE001 - the breakdown is a diagnosis, not the measurement
        profile = [{"error": f"{type(e).__name__}: {str(e)[:200]}"}]

    spec = model.spec
    el = model.dtype.itemsize
    expert_read = sum(n * expert_bytes(model.layers[i]) for i, n in
                      zip([i for i, l in enumerate(model.layers) if l.router is not None], touched))
    dense = 0
    for layer in model.layers:
        for name, t in vars(layer).items():
            if t is None or (layer.router is not None and name in ("gate_up", "down")):
                continue
            dense += t.numel() * t.element_size()
    dense += model.final_norm.numel() * el + model.lm_head.numel() * el + batch * model.hidden_size * el
    kv_read = 2 * spec.num_layers * batch * context * spec.num_kv_heads * spec.head_dim * el
    floor_us = (dense + expert_read + kv_read) / read_bw * 1e6
    narrow_floor_us = (expert_read + kv_read) / read_bw * 1e6
    return {"batch": batch, "context": context, "block_size": block_size,
            "touched_experts_per_layer": touched, "mean_touched_experts": statistics.mean(touched),
            "expert_bytes_read": expert_read, "other_weight_bytes_read": dense, "kv_bytes_read": kv_read,
            "graph_time_us": graph_us, "graphed": graphed, "eager_time_us_one_call": eager_us,
            "floor_us": floor_us, "x_floor": graph_us / floor_us,
            "experts_kv_floor_us": narrow_floor_us, "x_experts_kv_floor": graph_us / narrow_floor_us,
            "logits_finite": bool(torch.isfinite(logits).all()), "kernels": profile}


def kernel_profile(step, top: int = 14) -> list:
    """Device time per kernel name over one eager step (torch.profiler), the largest first:
    where the step's time goes (the sums exclude the launch gaps of an eager step)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:90]
            calls, us = totals.get(name, (0, 0.0))
            totals[name] = (calls + 1, us + e.time_range.elapsed_us())
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])
    return [{"kernel": name, "calls": calls, "device_us": round(us, 1)} for name, (calls, us) in rows[:top]] + [
        {"kernel": "(all)", "calls": sum(c for c, _ in totals.values()),
         "device_us": round(sum(u for _, u in totals.values()), 1)}]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python3 scripts/moe_device/moe_step.py " + " ".join(sys.argv[1:] if argv is None else argv)
    notes = {"shapes": {"model": args.model, "batch": args.batch, "context": args.context,
                        "block_size": args.block_size, "dtype": "bfloat16", "weights": "random, built on the GPU"},
             "timing": "graph_time_us / time_us: the call captured in one CUDA graph, median of 30 replays "
                       "(CUDA events) after 3; bandwidth: triton.testing.do_bench medians",
             "floor": "bytes the step must read (weights it uses, K/V) / measured read bandwidth"}
    result = {"metadata": metadata(command, notes), "model": args.model}

    def save():
        (out / "moe_step.json").write_text(json.dumps(result, indent=2) + "\n")

    result["bandwidth"] = bw = bandwidth()
    print(f"HBM read {bw['read_bytes_per_s'] / 1e12:.3f} TB/s, copy {bw['copy_bytes_per_s'] / 1e12:.3f} TB/s",
          flush=True)
    save()
    t0 = time.perf_counter()
    model = LlamaModel(load_model(args.model), "cuda", torch.bfloat16, seed=0, attention="triton")
    torch.cuda.synchronize()
    result["build_s"] = time.perf_counter() - t0
    result["weight_bytes"] = model.weight_bytes
    print(f"{args.model}: {model.weight_bytes / 1e9:.1f} GB of weights built in {result['build_s']:.1f} s", flush=True)
    read_bw = bw["read_bytes_per_s"]
    result["moe_layer"] = layer = moe_layer(model, args.batch, read_bw)
    save()
    print(f"\nexperts of one layer at batch {args.batch}: {layer['touched_experts']} touched, "
          f"rel_err {layer['rel_err']:.2e}, floor {layer['floor_us']:.1f} us")
    for c in layer["configs"]:
        cfg = f"m{c['block_m']} n{c['block_n']} k{c['block_k']} w{c['num_warps']} s{c['num_stages']}"
        print(f"  triton {cfg:22s} " + (f"{c['time_us']:8.1f} us  x{c['x_floor']:.2f}" if "time_us" in c
                                         else c["error"]))
    g = layer["torch_grouped_mm"]
    print("  torch._grouped_mm      " + (f"{g['time_us']:8.1f} us  x{g['x_floor']:.2f}  err {g['rel_err']:.1e}"
                                         if "time_us" in g else g["error"]), flush=True)
    result["decode_step"] = step = decode_step(model, args.batch, args.context, args.block_size, read_bw)
    save()
    print(f"\ndecode step, batch {args.batch} x {args.context} tokens: {step['graph_time_us'] / 1e3:.2f} ms "
          f"(graph); floor {step['floor_us'] / 1e3:.2f} ms -> x{step['x_floor']:.2f} "
          f"(experts + KV only: {step['experts_kv_floor_us'] / 1e3:.2f} ms, x{step['x_experts_kv_floor']:.2f}); "
          f"{step['mean_touched_experts']:.1f} experts touched per layer", flush=True)
    for k in step["kernels"]:
        print(f"  {k['device_us'] / 1e3:8.3f} ms  {k['calls']:5d} x  {k['kernel']}" if "kernel" in k else k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
