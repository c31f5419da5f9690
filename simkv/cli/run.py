"""`simkv size` (KV sizing arithmetic) and `simkv run` (one simulation)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from simkv.cli.common import (GIB, MIB, console, print_json, print_summary, print_warnings,
                              require, show_progress)
from simkv.errors import InputError


def size(
    model: str = typer.Option(..., "--model", "-m", help="Bundled model name or path to an HF config.json."),
    gpu: str = typer.Option("h200", "--gpu", "-g", help="Bundled GPU name."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block (power of two)."),
    kv_dtype: str = typer.Option("bf16", "--kv-dtype", help="KV cache dtype: bf16 or fp8 (vLLM's auto, bfloat16, fp8_e4m3, fp8_e5m2 too)."),
    weights_dtype: Optional[str] = typer.Option(
        None, "--weights-dtype",
        help="Serve the weights as bf16, fp8, int4 (group 128) or mxfp4 (experts); default: "
             "what the checkpoint holds (its quantization_config)."),
    gpu_memory_utilization: float = typer.Option(
        0.9, "--gpu-memory-utilization", help="Fraction of GPU memory simkv may use, in (0, 1]."),
    memory_budget_gib: Optional[float] = typer.Option(
        None, "--memory-budget-gib", help="Explicit budget in GiB (wins over the utilisation)."),
    max_num_batched_tokens: Optional[int] = typer.Option(
        None, "--max-num-batched-tokens",
        help="Token budget per step (sizes the activation workspace); default: the semantics'."),
    max_num_seqs: Optional[int] = typer.Option(
        None, "--max-num-seqs", help="Most sequences per step; default: the semantics'."),
    semantics: str = typer.Option(
        "vllm-0.26", "--semantics", help="vllm-0.26 (a null block, vLLM's limits) | vllm-0.18."),
    tensor_parallel_size: int = typer.Option(
        1, "--tensor-parallel-size", "--tp",
        help="GPUs one replica is split over (1..16); figures are per GPU, *_total beside."),
    max_model_len: Optional[int] = typer.Option(
        None, "--max-model-len",
        help="Tokens per request for the maximum concurrency; default: the model's context."),
    as_json: bool = typer.Option(False, "--json", help="Print the sizing as JSON."),
) -> None:
    """KV sizing arithmetic and pool size for a model on a GPU (per GPU of a TP replica)."""
    from simkv import semantics as rules
    from simkv.config.scenario import CacheConfig, SchedulerConfig
    from simkv.sizing import fit_error, size_pool
    from simkv.specs import (KV_DTYPE_ALIASES, KV_DTYPE_BYTES, kv_dtype_name, load_gpu,
                             load_model)

    from simkv.limits import budget_problem, check_number

    check_number(block_size, "cache.block_size", "--block-size")
    if block_size & (block_size - 1):
        raise InputError(f"--block-size: {block_size} is not a positive power of two (8, 16, 32, ...)")
    kv_dtype = kv_dtype_name(kv_dtype)          # vLLM's names too (fp8_e4m3, auto)
    if kv_dtype not in KV_DTYPE_BYTES:
        raise InputError(f"--kv-dtype: {kv_dtype!r} is not one of {', '.join(KV_DTYPE_BYTES)} "
                         f"(or vLLM's {', '.join(KV_DTYPE_ALIASES)})")
    check_number(gpu_memory_utilization, "cache.gpu_memory_utilization",
                 "--gpu-memory-utilization")
    if memory_budget_gib is not None:
        check_number(memory_budget_gib, "cache.memory_budget_gib", "--memory-budget-gib")
    if max_num_batched_tokens is not None:
        check_number(max_num_batched_tokens, "scheduler.max_num_batched_tokens",
                     "--max-num-batched-tokens")
    if max_num_seqs is not None:
        check_number(max_num_seqs, "scheduler.max_num_seqs", "--max-num-seqs")
    if semantics not in rules.SEMANTICS:
        raise InputError(f"--semantics: {semantics!r} is not one of {', '.join(rules.SEMANTICS)}")

    cache = CacheConfig(block_size=block_size, kv_dtype=kv_dtype,
                        gpu_memory_utilization=gpu_memory_utilization,
                        memory_budget_gib=memory_budget_gib)
    if max_model_len is not None:
        check_number(max_model_len, "scheduler.max_model_len", "--max-model-len")
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=max_model_len)
    gpu_spec = load_gpu(gpu)
    problem = budget_problem(memory_budget_gib, gpu_spec.name, gpu_spec.memory_bytes)
    if problem:
        raise InputError(f"--memory-budget-gib: {problem}")
    rules.resolve(semantics, cache, scheduler, gpu_spec)
    from simkv import parallel
    spec = load_model(model, weights_dtype=weights_dtype)
    problem = parallel.check(spec, tensor_parallel_size)
    if problem:
        raise InputError(f"--tensor-parallel-size: {problem}")
    if max_model_len is not None and max_model_len > spec.max_position_embeddings:
        raise InputError(f"--max-model-len: {max_model_len} exceeds {spec.name}'s "
                         f"max_position_embeddings ({spec.max_position_embeddings})")
    sizing = size_pool(spec, gpu_spec, cache, scheduler, tensor_parallel_size)
    problem = fit_error(sizing)
    if problem:
        raise InputError(problem)
    if as_json:
        print_json(sizing.to_dict())
        return
    _print_sizing(sizing)


def _print_sizing(sizing) -> None:
    from rich.table import Table

    def gib(n: int) -> str:
        return f"{n / GIB:,.2f} GiB"

    tp = sizing.tensor_parallel_size
    where = f"{sizing.gpu}" if tp == 1 else f"{tp} x {sizing.gpu} (tensor parallel; per GPU)"
    table = Table(title=f"{sizing.model} on {where}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    moe = sizing.moe
    params = f"{sizing.total_params / 1e9:,.2f} B"
    if moe:
        params += f" total, {sizing.active_params / 1e9:,.2f} B active"
    rows = [
        ("parameters", params),
        ("weights dtype", sizing.quantization or sizing.weights_dtype),
    ]
    if moe:
        rows += [
            ("experts", f"{moe['num_experts']} routed (top {moe['top_k']})"
             + (f" + {moe['num_shared_experts']} shared" if moe["num_shared_experts"] else "")
             + f" in {moe['num_moe_layers']} layers"),
            ("  one expert of one layer", f"{moe['expert_bytes'] / MIB:,.2f} MiB"),
            ("  MoE workspace (in activation)", gib(moe["moe_workspace_bytes"])),
        ]
    rows += [
        ("block size", f"{sizing.block_size} tokens, {sizing.kv_dtype}"),
        ("KV bytes per token", f"{sizing.bytes_per_token:,} B"),
        ("KV bytes per block", f"{sizing.bytes_per_block:,} B ({sizing.bytes_per_block / MIB:g} MiB)"),
        ("memory budget", gib(sizing.memory_budget_bytes)),
        ("  weights", gib(sizing.weights_bytes)),
        ("  activation workspace", gib(sizing.activation_bytes)),
        ("  other (context, graphs, slack)", gib(sizing.other_bytes)),
        ("  KV pool", gib(sizing.kv_pool_bytes)),
        ("KV blocks", f"{sizing.num_blocks:,}" + (
            f" usable of {sizing.num_gpu_blocks:,} (one is vLLM's null block)"
            if sizing.num_gpu_blocks is not None else "")),
        ("max cached tokens", f"{sizing.max_cached_tokens:,}"),
    ]
    if len(sizing.kv_groups) > 1:
        rows.append(("KV groups", f"{len(sizing.kv_groups)} of {sizing.layers_per_group} layers, "
                     f"page {sizing.page_bytes:,} B per layer"))
        for g in sizing.kv_groups:
            kind = g["attention_type"] + (f" (window {g['window']})" if g["window"] else "")
            per = (f"{g['state_bytes']:,} B state per sequence" if g["attention_type"] == "linear"
                   else f"{g['bytes_per_token']:,} B per token")
            rows.append((f"  group {g['group']}", f"{kind}, {g['num_layers']} layers, {per}"))
    rows += [
        (f"max concurrency at {sizing.max_model_len:,} tokens",
         f"{sizing.max_concurrency:.2f} ({sizing.blocks_per_request:,} blocks per request)"),
        ("source", sizing.source),
    ]
    if tp > 1:
        rows += [
            (f"all {tp} GPUs: weights", gib(sizing.weights_bytes * tp)),
            (f"all {tp} GPUs: KV bytes per token", f"{sizing.bytes_per_token * tp:,} B"),
            (f"all {tp} GPUs: KV pool", gib(sizing.kv_pool_bytes * tp)),
        ]
    for name, value in rows:
        table.add_row(name, value)
    out = console()
    out.print(table)
    if sizing.source == "estimate":
        out.print("activation and other are estimates: no profile ledger for this GPU and model yet")


def run(
    scenario: Path = typer.Argument(..., help="Scenario YAML file."),
    set_: list[str] = typer.Option([], "--set", help="Override a scenario key: KEY=VALUE (repeatable)."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Replace the workload with this trace file."),
    trace_format: Optional[str] = typer.Option(None, "--trace-format", help="auto|azure|mooncake|burstgpt|csv"),
    offset: Optional[int] = typer.Option(
        None, "--offset", help="Skip the workload's first N requests (= --set workload.offset=N)."),
    limit: Optional[int] = typer.Option(
        None, "--limit", help="Keep N requests after the offset (= --set workload.limit=N)."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Results folder (default results/<scenario name>-<hash of the "
                            "settings>, so that runs of different settings never share one)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    step_terms: bool = typer.Option(False, "--step-terms",
                                    help="Add a term_<name> column per cost term to steps.csv (seconds)."),
    exact: bool = typer.Option(False, "--exact",
                               help="Plan and time every step one by one (the same results, slower)."),
    export: list[str] = typer.Option(
        [], "--export", help="Also write the metrics in another tool's format: vllm "
                             "(vllm_bench.json, `vllm bench serve`'s names and units)."),
) -> None:
    """Simulate one scenario: print a summary, write summary.json, requests.csv, steps.csv."""
    from simkv.config.scenario import load_scenario

    for kind in export:
        if kind not in EXPORTS:
            raise InputError(f"--export: {kind!r} is not one of {', '.join(EXPORTS)}")
    overrides = _run_overrides(set_, trace, trace_format)
    overrides.update({f"workload.{k}": v for k, v in (("offset", offset), ("limit", limit))
                      if v is not None})
    scn = load_scenario(scenario, overrides)
    simulate = require("simkv.sim.engine", "simulate", "run")
    result = simulate(scn, progress=not as_json and show_progress(), step_terms=step_terms,
                      exact=exact)
    out_dir = out if out is not None else default_out_dir(scn.name, result.provenance)
    result.write(out_dir)
    if "vllm" in export:
        import json
        from simkv.engine.results import atomic_write_text
        atomic_write_text(out_dir / EXPORTS["vllm"], json.dumps(result.vllm_bench(), indent=2) + "\n")
    print_warnings(result.summary)
    if as_json:
        print_json(result.summary_json())
        return
    title = f"{scn.name}: {scn.model.name} on {scn.gpu.name}"
    if scn.cluster is not None:
        from simkv.cli.fleet import print_fleet_summary
        print_fleet_summary(result.summary, title=f"{scn.name}: a fleet of "
                            f"{scn.cluster.num_replicas} replicas ({scn.model.name})")
    else:
        print_summary(result.summary, title=title)
    print_caveats(result.provenance)
    console().print(f"results written to {out_dir}/")


def default_out_dir(name: str, provenance: dict) -> Path:
    """results/<name>-<8 hex digits of the settings and the trace's hash>."""
    from simkv.sim.provenance import settings_key
    return Path("results") / f"{name}-{settings_key(provenance)}"


def print_caveats(provenance: dict | None) -> None:
    """The provenance's caveats, one line each, after the summary."""
    for caveat in (provenance or {}).get("caveats", []):
        console().print(f"[yellow]caveat:[/yellow] {caveat}", highlight=False)


EXPORTS = {"vllm": "vllm_bench.json"}


def explain(
    scenario: Path = typer.Argument(..., help="Scenario YAML file."),
    step: int = typer.Option(..., "--step", help="The step to explain (steps.csv's `step`, from 1)."),
    set_: list[str] = typer.Option([], "--set", help="Override a scenario key: KEY=VALUE (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print {step, plan, terms, seconds} as JSON."),
) -> None:
    """One simulated step: its plan and the cost model's terms, which sum to its seconds."""
    from simkv.config.scenario import load_scenario
    from simkv.limits import check_number

    check_number(step, "--step", "--step")

    scn = load_scenario(scenario, _run_overrides(set_, None, None))
    explain_step = require("simkv.sim.explain", "explain_step", "explain")
    found = explain_step(scn, step)
    if as_json:
        print_json(found)
        return
    from simkv.sim.explain import format_explanation
    print(format_explanation(found))


def _run_overrides(set_: list[str], trace: Optional[Path], trace_format: Optional[str]) -> dict:
    from simkv.config.scenario import parse_set

    overrides = parse_set(set_)
    if trace is not None:
        if not trace.is_file():
            raise InputError(f"--trace: no such file: {trace} (the public traces: README, "
                             "Public traces)")
        overrides["workload.trace"] = str(trace.resolve())
        overrides["workload.synthetic"] = None
    if trace_format is not None:
        overrides["workload.format"] = trace_format
    return overrides
