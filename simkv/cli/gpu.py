"""The GPU side: `simkv replay`, `simkv profile`, `simkv bench kernels|tune`.

The GPU machine has no simpy, so none of these imports the simulator; torch is asked for
through simkv.gpu.device inside each command.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from simkv.cli.common import (call_main, check_device, console, flag, int_list, print_summary,
                              require)
from simkv.errors import InputError

bench_app = typer.Typer(help="Benchmarks on the GPU side.", no_args_is_help=True)


def replay(
    scenario: Path = typer.Argument(..., help="Scenario YAML."),
    device: str = typer.Option("cuda", "--device", help="cuda | cpu"),
    set_: list[str] = typer.Option([], "--set", help="KEY=VALUE override (repeatable)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder."),
    save_tokens: bool = typer.Option(False, "--save-tokens", help="Also write tokens.jsonl."),
    offline: bool = typer.Option(False, "--offline",
                                 help="All requests arrive at 0 (saturated throughput)."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="No CUDA graphs."),
) -> None:
    """Run a scenario on the real engine (arrivals by the wall clock); same files as `run`."""
    check_device(device)
    from simkv.config.scenario import load_scenario, parse_set
    from simkv.gpu.device import cuda_available, require_torch

    scn = load_scenario(scenario, parse_set(set_))
    require_torch("simkv replay")
    if device == "cuda" and not cuda_available():
        raise InputError("--device cuda: no CUDA GPU here (use --device cpu with a small model)")
    out_dir = out if out is not None else Path("results") / f"{scn.name}-replay"
    if scn.tensor_parallel_size > 1:       # one process per rank, rank 0 writes the files
        run_replay = require("simkv.gpu.tensor_parallel", "replay", "replay")
        summary = run_replay(scn, device=device, out_dir=out_dir, save_tokens=save_tokens,
                             realtime=not offline, enforce_eager=enforce_eager)["summary"]
        where = f"{scn.tensor_parallel_size} x {device} (tensor parallel)"
    else:
        run_replay = require("simkv.gpu.engine", "replay", "replay")
        summary = run_replay(scn, device=device, out_dir=out_dir, save_tokens=save_tokens,
                             realtime=not offline, enforce_eager=enforce_eager,
                             progress=True).summary
        where = device
    print_summary(summary, title=f"{scn.name}: measured on {where}")
    console().print(f"results written to {out_dir}/")


def profile(
    model: str = typer.Option(..., "--model", help="Bundled model name or config.json path."),
    block_sizes: str = typer.Option("8,16,32,64,128", "--block-sizes"),
    out: Optional[Path] = typer.Option(None, "--out", help="Default profiles/<gpu>/<model>/."),
    quick: bool = typer.Option(False, "--quick", help="A few points (smoke test)."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda (default) | cpu"),
    time_budget_s: Optional[float] = typer.Option(
        None, "--time-budget-s", help="Skip the block sizes that would not finish in time."),
    reps: Optional[int] = typer.Option(None, "--reps", min=1,
                                       help="Timed rounds over the design (default 5)."),
    parts: Optional[str] = typer.Option(
        None, "--parts", help="Comma-separated, of steps, transfers, ledger, host_noise, engine "
                              "(the default set), rested, serving."),
    fit: bool = typer.Option(False, "--fit", help="Then fit the cost model (fit.json), as "
                                                  "`simkv fit` does, and print its hold-out "
                                                  "error."),
    pin_cpu: Optional[int] = typer.Option(
        None, "--pin-cpu", metavar="N",
        help="Run pinned to CPU N (then measure validations with `simkv validate measure "
             "--pin-cpu N` too)."),
    tensor_parallel_size: int = typer.Option(
        1, "--tensor-parallel-size", "--tp",
        help="Profile a replica of N GPUs, one process per rank (steps, transfers and "
             "all-reduce times; folder profiles/<gpu>/<model>-tp<N>/)."),
) -> int:
    """Measure step costs, transfers and the memory ledger on a GPU; writes raw CSVs."""
    int_list(block_sizes, "--block-sizes")
    profiler_main = require("simkv.gpu.profiler", "main", "profile")
    argv = ["--model", model, "--block-sizes", block_sizes, *flag("--out", out),
            *(["--quick"] if quick else []), *flag("--device", device),
            *flag("--time-budget-s", time_budget_s), *flag("--reps", reps),
            *flag("--parts", parts), *flag("--pin-cpu", pin_cpu),
            *(["--tensor-parallel-size", str(tensor_parallel_size)]
              if tensor_parallel_size != 1 else [])]
    return call_main(profiler_main, argv + (["--fit"] if fit else []),
                     **(_fit_hook(profiler_main) if fit else {}))


def _fit_hook(profiler_main) -> dict:
    """The fitting the profiler's main runs with --fit: simkv.fitting sits above simkv.gpu, so
    the command hands `fit_profile(profile_dir) -> dict` in (a main without the parameter fits
    by itself)."""
    import inspect

    if "fit_profile" not in inspect.signature(profiler_main).parameters:
        return {}

    def fit_profile(profile_dir):
        return require("simkv.fitting.fit", "fit_profile", "profile --fit")(profile_dir)

    return {"fit_profile": fit_profile}


def _require_cuda(command: str) -> None:
    from simkv.gpu.device import cuda_available, require_torch

    require_torch(command)
    if not cuda_available():
        raise InputError(f"{command} needs a CUDA GPU")


@bench_app.command("kernels")
def bench_kernels(
    out: Path = typer.Option(Path("profiles/h200/kernels.csv"), "--out"),
    quick: bool = typer.Option(False, "--quick", help="A few points only."),
    configs: Optional[Path] = typer.Option(
        None, "--configs", help="Launch parameters from `simkv bench tune` (its best.json) "
                                "instead of the defaults."),
    block_sizes: Optional[str] = typer.Option(
        None, "--block-sizes", help="Comma-separated block sizes (default: all)."),
    time_budget_s: Optional[float] = typer.Option(
        None, "--time-budget-s", help="Start no new point after this many seconds (the target "
                                      "points run first)."),
    no_steady: bool = typer.Option(False, "--no-steady", help="Per-call timing only."),
) -> None:
    """Benchmark the paged attention kernels against SDPA on contiguous KV (needs a GPU)."""
    sizes = tuple(int_list(block_sizes, "--block-sizes")) if block_sizes is not None else None
    _require_cuda("simkv bench kernels")
    run_kernel_bench = require("simkv.gpu.bench", "run_kernel_bench", "bench kernels")
    if configs is not None:
        require("simkv.gpu.bench", "load_tuned", "bench kernels")(str(configs))
    run_kernel_bench(out, quick=quick, command="simkv bench kernels " + " ".join(sys.argv[3:]),
                     block_sizes=sizes, time_budget_s=time_budget_s, steady=not no_steady)


@bench_app.command("tune")
def bench_tune(
    out: Path = typer.Option(Path("kernel_tune"), "--out",
                             help="Folder for tune.csv and best.json."),
    quick: bool = typer.Option(False, "--quick", help="Decode split policy at batch 1/4/8 and "
                               "the prefill sweep at 8 x 2048 only; budget 170 s unless "
                               "--time-budget-s."),
    time_budget_s: Optional[float] = typer.Option(
        None, "--time-budget-s", help="Start no new measurement after this many seconds."),
    configs: Optional[Path] = typer.Option(
        None, "--configs", help="Start from the launch parameters of an earlier best.json."),
) -> None:
    """Sweep the paged kernels' launch parameters at the target points (needs a GPU)."""
    _require_cuda("simkv bench tune")
    run_tune = require("simkv.gpu.bench", "run_tune", "bench tune")
    if configs is not None:
        require("simkv.gpu.bench", "load_tuned", "bench tune")(str(configs))
    budget = time_budget_s if time_budget_s is not None else (170.0 if quick else None)
    run_tune(str(out), quick=quick, time_budget_s=budget)
