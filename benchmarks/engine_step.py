"""Decode step time of the real engine against its bytes floor, and the host overhead per step.

    python benchmarks/engine_step.py [--model llama-3.1-8b] [--context 1000] [--out DIR]
    python benchmarks/engine_step.py --replay TRACE [--limit 300] [--out DIR]

For each batch size (default 1 and 64), sequences of `--context` tokens of context decode one
token each, on the sample model with random bf16 weights and random K/V:

- graph_gpu_ms: device time of one decode step as a CUDA graph (CUDA events around replays,
  median of 50) — what the step costs the GPU;
- execute_ms / execute_gpu_ms / execute_prep_ms: wall time of `GpuExecutor.execute(plan)` (host
  input preparation, copies, replay, sampling, sync), its CUDA-event span and the host input
  preparation inside that span; execute_host_ms = wall − span + preparation is the host overhead
  of the executor;
- eager_gpu_ms: the same step without CUDA graphs (launch-bound);
- engine_step_ms / engine_gpu_ms / engine_host_ms: medians over the decode-only steps of a real
  engine run (scheduler + KV manager + executor, `run_offline`) of `batch` requests with a
  `context`-token prompt: step duration, its device time, and the time the device waits for the
  host (scheduling, input preparation, bookkeeping);
- floor_ms: (weight bytes + K/V bytes read) / 4.2 TB/s (the measured copy bandwidth of the H200;
  `copy_tbps` re-measures it in the same run).

Writes engine_step.csv and engine_step.json (GPU, versions, date, command) under --out.

With `--replay TRACE` it instead replays the first `--limit` requests of a trace (format by
`--format`, default auto) on `--model` with the scenario defaults (h200, block 16, 0.9 of the
memory, prefix caching, 256 seqs, 8192 tokens per step) in real time, and writes the replay's
result files (summary.json, requests.csv, steps.csv, ledger.json) under --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

FLOOR_BANDWIDTH = 4.2e12   # bytes/s: device-to-device copy measured on the project's H200


def copy_bandwidth(device) -> float:
    """Bytes read + written per second of a 4 GiB device-to-device copy (median of 10)."""
    src = torch.empty(1 << 31, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * (1 << 32) / statistics.median(times[2:])


def decode_plan(batch: int, context: int, block_size: int, vocab: int, first_block: int):
    """A StepPlan decoding `batch` sequences of `context` tokens (blocks laid out in order)."""
    from simkv.engine.plan import ScheduledSeq, StepPlan
    from simkv.engine.request import Request, Sequence
    blocks = -(-context // block_size)
    gen = torch.Generator().manual_seed(batch)
    plan = StepPlan(step=1, now_s=0.0)
    for i in range(batch):
        req = Request(i, 0.0, context - 1, 2)
        seq = Sequence(i, req, 0, context)
        seq.num_computed_tokens = context - 1
        seq.block_table = list(range(first_block + i * blocks, first_block + (i + 1) * blocks))
        seq.token_ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
        plan.scheduled.append(ScheduledSeq(seq, context - 1, 1, True))
    plan.num_decode_tokens = batch
    return plan


def time_graph(executor, batch: int, reps: int = 50) -> float:
    graph = executor.steps.decode_graphs[batch][0]
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_execute(executor, plan, reps: int = 30) -> tuple:
    """Medians of execute()'s wall time, its CUDA-event span and the host preparation in it."""
    walls, gpus, preps = [], [], []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        executor.execute(plan)
        walls.append(time.perf_counter() - t0)
        gpus.append(executor.last_gpu_s)
        preps.append(executor.last_prep_s)
    return tuple(statistics.median(x[3:]) for x in (walls, gpus, preps))


def engine_steps(executor, model: str, batch: int, context: int, block_size: int,
                 output_tokens: int) -> dict:
    """Medians over the decode-only steps of a real engine run of `batch` requests."""
    import simkv
    from simkv.engine.request import Request
    from simkv.gpu.engine import run_offline
    raw = {"name": "engine-step", "model": model, "gpu": "h200",
           "cache": {"block_size": block_size, "num_gpu_blocks_override": executor.num_blocks,
                     "enable_prefix_caching": False},
           "scheduler": {"max_num_seqs": batch, "max_num_batched_tokens": 8192,
                         "max_model_len": context + output_tokens},
           "workload": {"synthetic": {"num_requests": 1, "output_tokens": 1,
                                      "prompt_tokens": {"dist": "fixed", "value": 8}}}}
    scn = simkv.load_scenario(raw)
    requests = [Request(i, 0.0, context - 1, output_tokens) for i in range(batch)]
    run = run_offline(scn, requests, executor=executor, check_integrity=False, poison=False)
    steps = run.result.steps
    decode = steps[(steps["num_prefill_tokens"] == 0) & (steps["num_decode_tokens"] == batch)]
    return {"engine_steps": int(len(decode)),
            "engine_step_ms": 1e3 * float(decode["duration_s"].median()),
            "engine_gpu_ms": 1e3 * float(decode["gpu_s"].median()),
            "engine_host_ms": 1e3 * float(decode["host_s"].median())}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=48)
    parser.add_argument("--out", default=str(ROOT / "profiles/h200/engine"))
    parser.add_argument("--replay", help="trace to replay in real time instead")
    parser.add_argument("--format", default="auto")
    parser.add_argument("--limit", type=int, default=300)
    return parser


def _measure_batch(executor, spec, args, batch: int) -> dict:
    """One batch size's row: the bytes floor, graph, execute, eager and engine step times."""
    bs = args.block_size
    weight_bytes = executor.weight_bytes
    plan = decode_plan(batch, args.context, bs, spec.vocab_size, first_block=0)
    kv_read = batch * args.context * spec.kv_bytes_per_token("bf16")
    floor_s = (weight_bytes + kv_read) / FLOOR_BANDWIDTH
    executor.execute(plan)
    graph_s = time_graph(executor, next(b for b in executor.steps.decode_buckets() if b >= batch))
    wall_s, gpu_s, prep_s = time_execute(executor, plan)
    executor.use_graphs = False
    eager_wall_s, eager_gpu_s, _ = time_execute(executor, plan, reps=10)
    executor.use_graphs = True
    row = {"model": spec.name, "batch": batch, "context": args.context, "block_size": bs,
           "dtype": "bf16", "weight_bytes": weight_bytes, "kv_read_bytes": kv_read,
           "floor_ms": 1e3 * floor_s, "graph_gpu_ms": 1e3 * graph_s,
           "graph_over_floor": graph_s / floor_s,
           "achieved_tbps": (weight_bytes + kv_read) / graph_s / 1e12,
           "execute_ms": 1e3 * wall_s, "execute_gpu_ms": 1e3 * gpu_s,
           "execute_host_ms": 1e3 * (wall_s - gpu_s + prep_s),
           "execute_prep_ms": 1e3 * prep_s,
           "eager_ms": 1e3 * eager_wall_s, "eager_gpu_ms": 1e3 * eager_gpu_s}
    row.update(engine_steps(executor, args.model, batch, args.context, bs, args.output_tokens))
    row["engine_over_floor"] = row["engine_step_ms"] / row["floor_ms"]
    return row


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.replay:
        return replay_trace(args)

    import triton

    from simkv.specs import load_model
    from simkv.gpu.executor import GpuExecutor

    device = torch.device("cuda")
    spec = load_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    bs = args.block_size
    blocks_per_seq = -(-(args.context + args.output_tokens) // bs)
    num_blocks = max(batches) * blocks_per_seq + 64
    copy_tbps = copy_bandwidth(device) / 1e12
    t0 = time.perf_counter()
    executor = GpuExecutor(spec, num_blocks, bs, device="cuda", dtype=torch.bfloat16,
                           attention="triton", max_num_seqs=max(batches), seed=0)
    setup_s = time.perf_counter() - t0
    executor.caches.normal_()            # random K/V: never time on zeros
    rows = []
    for batch in batches:
        rows.append(_measure_batch(executor, spec, args, batch))
        print(json.dumps(rows[-1]), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import pandas as pd
    pd.DataFrame(rows).to_csv(out / "engine_step.csv", index=False, float_format="%.6g")
    meta = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python " + " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "floor_bandwidth_bytes_per_s": FLOOR_BANDWIDTH, "copy_tbps_measured": copy_tbps,
            "executor_setup_s": setup_s, "num_blocks": num_blocks,
            "graph_batch_sizes": executor.steps.decode_buckets(), "profile": executor.profile}
    (out / "engine_step.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"\n{'batch':>5} {'floor':>7} {'graph':>7} {'x':>5} {'exec':>7} {'host':>6} "
          f"{'eager':>7} {'engine':>7} {'e.host':>6}   (ms)  copy {copy_tbps:.2f} TB/s")
    for r in rows:
        print(f"{r['batch']:>5} {r['floor_ms']:7.2f} {r['graph_gpu_ms']:7.2f} "
              f"{r['graph_over_floor']:5.2f} {r['execute_ms']:7.2f} {r['execute_host_ms']:6.2f} "
              f"{r['eager_gpu_ms']:7.2f} {r['engine_step_ms']:7.2f} {r['engine_host_ms']:6.2f}")
    return 0


def replay_trace(args) -> int:
    """A real-time replay of a trace's first `--limit` requests (scenario defaults)."""
    import simkv
    from simkv.gpu.engine import replay
    raw = {"name": f"replay-{Path(args.replay).stem}-{args.limit}", "model": args.model,
           "gpu": "h200", "cache": {"block_size": args.block_size},
           "workload": {"trace": str(Path(args.replay).resolve()), "format": args.format,
                        "limit": args.limit}}
    scn = simkv.load_scenario(raw)
    res = replay(scn, device="cuda", out_dir=args.out, progress=True)
    s, led = res.summary, res.ledger
    print(json.dumps({k: s[k] for k in ("requests_completed", "requests_total", "sim_duration_s",
                                        "num_steps", "preemptions", "throughput_output_tokens_per_s",
                                        "step_gpu_s_mean", "step_host_s_mean", "num_blocks")}))
    print("ttft_s", s["ttft_s"], "tpot_s", s["tpot_s"])
    print(json.dumps({k: v for k, v in led.items() if k != "stages" and not isinstance(v, dict)}))
    return 0 if s["requests_completed"] == s["requests_total"] and led.get("reconciled") else 1


if __name__ == "__main__":
    raise SystemExit(main())
