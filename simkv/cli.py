"""The `simkv` command line (typer). `python cli.py ...` and `python -m simkv.cli ...` are the same.

Every bad input ends the same way: one line `error: ...` on stderr and exit code 2, never a
traceback (see `main`). Heavy imports (pandas, simpy, torch) happen inside the commands so that
`simkv --help` stays fast.
"""
from __future__ import annotations

import json
import numbers
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from simkv.errors import InputError

app = typer.Typer(
    name="simkv",
    help="Capacity planning for LLM serving with a paged KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
trace_app = typer.Typer(help="Inspect request traces and convert them to the canonical CSV.",
                        no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks on the GPU side.", no_args_is_help=True)
app.add_typer(trace_app, name="trace")
app.add_typer(bench_app, name="bench")

EXIT_FAILED = 1      # a check or assertion failed
EXIT_BAD_INPUT = 2   # bad input: one line `error: ...` on stderr
TRACE_FORMATS = ("auto", "azure", "mooncake", "burstgpt", "csv")
GIB = 1 << 30
MIB = 1 << 20


def _not_available(command: str, detail: str = "") -> InputError:
    return InputError(f"simkv {command} is not available yet{detail}")


def _require(module: str, attr: str, command: str) -> Any:
    """`module.attr`, or InputError 'not available yet' if that module is not written yet."""
    import importlib

    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as e:
        # Missing simkv modules are work in progress; a missing third-party package is not.
        if e.name is not None and e.name.split(".")[0] == "simkv":
            raise _not_available(command, f" (needs {e.name})") from None
        raise
    if not hasattr(found, attr):
        raise _not_available(command, f" (needs {module}.{attr})")
    return getattr(found, attr)


def _console():
    from rich.console import Console

    return Console()


def _fmt(value: Any) -> str:
    """A number for a table: thousands separators, four significant digits below 10,000."""
    if value is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    if isinstance(value, numbers.Real):
        value = float(value)
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value)


def _print_json(data: Any) -> None:
    def plain(value: Any) -> Any:  # numpy scalars, paths
        return value.item() if hasattr(value, "item") else str(value)

    print(json.dumps(data, indent=2, default=plain))


# ----------------------------------------------------------------------------------------------
# size


@app.command()
def size(
    model: str = typer.Option(..., "--model", "-m", help="Bundled model name or path to an HF config.json."),
    gpu: str = typer.Option("h200", "--gpu", "-g", help="Bundled GPU name."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block (power of two)."),
    kv_dtype: str = typer.Option("bf16", "--kv-dtype", help="KV cache dtype: bf16 or fp8."),
    gpu_memory_utilization: float = typer.Option(
        0.9, "--gpu-memory-utilization", help="Fraction of GPU memory simkv may use, in (0, 1]."),
    memory_budget_gib: Optional[float] = typer.Option(
        None, "--memory-budget-gib", help="Explicit budget in GiB (wins over the utilisation)."),
    max_num_batched_tokens: int = typer.Option(
        8192, "--max-num-batched-tokens", help="Token budget per step (sizes the activation workspace)."),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="Most sequences per step."),
    as_json: bool = typer.Option(False, "--json", help="Print the sizing as JSON."),
) -> None:
    """KV sizing arithmetic and pool size for a model on a GPU."""
    from simkv.config.scenario import CacheConfig, SchedulerConfig
    from simkv.sizing import fit_error, size_pool
    from simkv.specs import KV_DTYPE_BYTES, load_gpu, load_model

    if block_size <= 0 or block_size & (block_size - 1):
        raise InputError(f"--block-size: {block_size} is not a positive power of two (8, 16, 32, ...)")
    if kv_dtype not in KV_DTYPE_BYTES:
        raise InputError(f"--kv-dtype: {kv_dtype!r} is not one of {', '.join(KV_DTYPE_BYTES)}")
    if not 0 < gpu_memory_utilization <= 1:
        raise InputError(f"--gpu-memory-utilization: {gpu_memory_utilization} is not in (0, 1]")
    if memory_budget_gib is not None and memory_budget_gib <= 0:
        raise InputError(f"--memory-budget-gib: must be > 0, got {memory_budget_gib}")
    if max_num_batched_tokens <= 0 or max_num_seqs <= 0:
        raise InputError("--max-num-batched-tokens and --max-num-seqs must be > 0")

    cache = CacheConfig(block_size=block_size, kv_dtype=kv_dtype,
                        gpu_memory_utilization=gpu_memory_utilization,
                        memory_budget_gib=memory_budget_gib)
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    sizing = size_pool(load_model(model), load_gpu(gpu), cache, scheduler)
    problem = fit_error(sizing)
    if problem:
        raise InputError(problem)
    if as_json:
        _print_json(sizing.to_dict())
        return
    _print_sizing(sizing)


def _print_sizing(sizing) -> None:
    from rich.table import Table

    def gib(n: int) -> str:
        return f"{n / GIB:,.2f} GiB"

    table = Table(title=f"{sizing.model} on {sizing.gpu}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("block size", f"{sizing.block_size} tokens, {sizing.kv_dtype}"),
        ("KV bytes per token", f"{sizing.bytes_per_token:,} B"),
        ("KV bytes per block", f"{sizing.bytes_per_block:,} B ({sizing.bytes_per_block / MIB:g} MiB)"),
        ("memory budget", gib(sizing.memory_budget_bytes)),
        ("  weights", gib(sizing.weights_bytes)),
        ("  activation workspace", gib(sizing.activation_bytes)),
        ("  other (context, graphs, slack)", gib(sizing.other_bytes)),
        ("  KV pool", gib(sizing.kv_pool_bytes)),
        ("KV blocks", f"{sizing.num_blocks:,}"),
        ("max cached tokens", f"{sizing.max_cached_tokens:,}"),
        ("source", sizing.source),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console = _console()
    console.print(table)
    if sizing.source == "estimate":
        console.print("activation and other are estimates: no profile ledger for this GPU and model yet")


# ----------------------------------------------------------------------------------------------
# run


@app.command()
def run(
    scenario: Path = typer.Argument(..., help="Scenario YAML file."),
    set_: list[str] = typer.Option([], "--set", help="Override a scenario key: KEY=VALUE (repeatable)."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Replace the workload with this trace file."),
    trace_format: Optional[str] = typer.Option(None, "--trace-format", help="auto|azure|mooncake|burstgpt|csv"),
    out: Optional[Path] = typer.Option(None, "--out", help="Results folder (default results/<scenario name>)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Simulate one scenario: print a summary, write summary.json, requests.csv, steps.csv."""
    from simkv.config.scenario import load_scenario, parse_set
    from simkv.sim.engine import simulate

    overrides = parse_set(set_)
    if trace is not None:
        overrides["workload.trace"] = str(trace.resolve())
        overrides["workload.synthetic"] = None
    if trace_format is not None:
        overrides["workload.format"] = trace_format
    scn = load_scenario(scenario, overrides)
    _require("simkv.sim.engine", "simulate", "run")
    result = simulate(scn, progress=not as_json)
    out_dir = out if out is not None else Path("results") / scn.name
    result.write(out_dir)
    if as_json:
        _print_json(result.summary)
        return
    _print_summary(result.summary, title=f"{scn.name}: {scn.model.name} on {scn.gpu.name}")
    _console().print(f"results written to {out_dir}/")


def _print_summary(summary: dict[str, Any], title: str) -> None:
    from rich.table import Table

    scalars = Table(title=title, show_header=False)
    scalars.add_column(style="bold")
    scalars.add_column(justify="right")
    latencies = Table(title="latency and per-step distributions")
    latencies.add_column("metric", style="bold")
    for stat in ("mean", "p50", "p90", "p99"):
        latencies.add_column(stat, justify="right")
    for key, value in summary.items():
        if isinstance(value, dict):
            latencies.add_row(key, *(_fmt(value.get(s)) for s in ("mean", "p50", "p90", "p99")))
        else:
            scalars.add_row(key, _fmt(value))
    console = _console()
    console.print(scalars)
    if latencies.row_count:
        console.print(latencies)


# ----------------------------------------------------------------------------------------------
# trace


def _check_format(fmt: str) -> None:
    if fmt not in TRACE_FORMATS:
        raise InputError(f"--format: {fmt!r} is not one of {', '.join(TRACE_FORMATS)}")


@trace_app.command("stats")
def trace_stats(
    path: Path = typer.Argument(..., help="Trace file."),
    fmt: str = typer.Option("auto", "--format", help="auto|azure|mooncake|burstgpt|csv"),
    as_json: bool = typer.Option(False, "--json", help="Print the statistics as JSON."),
) -> None:
    """Request count, duration, rate and token-length percentiles of a trace."""
    _check_format(fmt)
    load_trace = _require("simkv.workload.traces", "load_trace", "trace stats")
    stats_of = _require("simkv.workload.traces", "trace_stats", "trace stats")
    stats = stats_of(load_trace(path, format=fmt))
    if as_json:
        _print_json(stats)
        return
    from rich.table import Table

    table = Table(title=str(path), show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in _flatten(stats).items():
        table.add_row(key, _fmt(value))
    _console().print(table)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@trace_app.command("convert")
def trace_convert(
    path: Path = typer.Argument(..., help="Trace file."),
    out: Path = typer.Argument(..., help="Canonical CSV to write."),
    fmt: str = typer.Option("auto", "--format", help="auto|azure|mooncake|burstgpt|csv"),
) -> None:
    """Convert a trace to the canonical CSV (arrival_s, prompt_tokens, output_tokens, ...)."""
    _check_format(fmt)
    load_trace = _require("simkv.workload.traces", "load_trace", "trace convert")
    write_canonical = _require("simkv.workload.traces", "write_canonical", "trace convert")
    df = load_trace(path, format=fmt)
    write_canonical(df, out)
    _console().print(f"wrote {len(df):,} requests to {out}")


# ----------------------------------------------------------------------------------------------
# What-if: sweep, capacity, check


@app.command("sweep")
def sweep(
    scenario: Path = typer.Argument(..., help="Scenario YAML."),
    grid: list[str] = typer.Option(..., "--grid", help="KEY=V1,V2,... (repeatable)."),
    set_: list[str] = typer.Option([], "--set", help="KEY=VALUE applied to every point."),
    backend: str = typer.Option("local", "--backend", help="local (process pool) | dask"),
    dask_address: Optional[str] = typer.Option(None, "--dask-address",
                                               help="dask scheduler; default a LocalCluster"),
    out: Optional[Path] = typer.Option(None, "--out", help="Output folder."),
    resume: bool = typer.Option(False, "--resume", help="Skip points already in sweep.csv."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Parallel points."),
) -> int:
    """What-if grid over scenario keys; one row per point in sweep.csv, written as points finish."""
    if backend not in ("local", "dask"):
        raise InputError(f"--backend: {backend!r} is not one of local, dask")
    sweep_command = _require("simkv.whatif.commands", "sweep_command", "sweep")
    return sweep_command(scenario, grid, set_, backend=backend, dask_address=dask_address,
                         out_dir=out, resume=resume, workers=workers)


@app.command("capacity")
def capacity(
    scenario: Path = typer.Argument(..., help="Scenario YAML with an slo: section."),
    set_: list[str] = typer.Option([], "--set", help="KEY=VALUE override (repeatable)."),
    replicates: int = typer.Option(1, "--replicates", help="Seeds / bootstrap resamples."),
    tolerance: float = typer.Option(0.02, "--tolerance", help="Relative bisection tolerance."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> int:
    """Highest request rate (by scaling inter-arrival times) that meets every SLO."""
    capacity_command = _require("simkv.whatif.commands", "capacity_command", "capacity")
    return capacity_command(scenario, set_, replicates=replicates, tolerance=tolerance,
                            as_json=as_json)


@app.command("check")
def check(
    checks: Path = typer.Argument(..., help="Checks YAML."),
    junit: Optional[Path] = typer.Option(None, "--junit", help="Write JUnit XML here."),
) -> int:
    """Sizing assertions for CI: exit 0 when all hold, 1 when one fails."""
    check_command = _require("simkv.whatif.commands", "check_command", "check")
    return check_command(checks, junit)


# ----------------------------------------------------------------------------------------------
# GPU side: replay, profile, fit, bench


@app.command("replay")
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
    if device not in ("cuda", "cpu"):
        raise InputError(f"--device: {device!r} is not one of cuda, cpu")
    from simkv.config.scenario import load_scenario, parse_set

    scn = load_scenario(scenario, parse_set(set_))
    try:
        import torch
    except ImportError:
        raise InputError("simkv replay needs torch: pip install -e '.[gpu]'") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA GPU here (use --device cpu with a small model)")
    run_replay = _require("simkv.gpu.engine", "replay", "replay")
    out_dir = out if out is not None else Path("results") / f"{scn.name}-replay"
    result = run_replay(scn, device=device, out_dir=out_dir, save_tokens=save_tokens,
                        realtime=not offline, enforce_eager=enforce_eager, progress=True)
    _print_summary(result.summary, title=f"{scn.name}: measured on {device}")
    _console().print(f"results written to {out_dir}/")


@app.command("profile")
def profile(
    model: str = typer.Option(..., "--model", help="Bundled model name or config.json path."),
    block_sizes: str = typer.Option("8,16,32,64,128", "--block-sizes"),
    out: Optional[Path] = typer.Option(None, "--out", help="Default profiles/<gpu>/<model>/."),
    quick: bool = typer.Option(False, "--quick", help="A few points (smoke test)."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda (default) | cpu"),
    reps: Optional[int] = typer.Option(None, "--reps", min=1,
                                       help="Timed rounds over the design (default 5)."),
    pin_cpu: Optional[int] = typer.Option(
        None, "--pin-cpu", metavar="N",
        help="Run pinned to CPU N (then measure validations with `python -m simkv.validate "
             "measure --pin-cpu N` too)."),
) -> None:
    """Measure step costs, transfers and the memory ledger on a GPU; writes raw CSVs."""
    sizes = _int_list(block_sizes, "--block-sizes")
    run_profile = _require("simkv.gpu.profiler", "run_profile", "profile")
    path = run_profile(model, block_sizes=sizes, out_dir=out, quick=quick, device=device,
                       reps=reps, pin_cpu=pin_cpu)
    _console().print(f"profile written to {path}/")


@app.command("fit")
def fit(
    profile_dir: Path = typer.Argument(..., help="A profile folder with raw CSVs."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where fit.json goes (default: DIR)."),
    as_json: bool = typer.Option(False, "--json", help="Print the fit as JSON."),
) -> None:
    """Fit the step-cost model to a profile's raw measurements (fit.json)."""
    fit_profile = _require("simkv.fitting.fit", "fit_profile", "fit")
    result = fit_profile(profile_dir, out=out)
    if as_json:
        _print_json(result)
        return
    err = result.get("holdout_error", {})
    _console().print(f"fit written to {(out or profile_dir) / 'fit.json'}; held-out error "
                     f"median {_fmt(err.get('median'))}, p95 {_fmt(err.get('p95'))}; block sizes "
                     f"{result.get('block_sizes')}")


@bench_app.command("kernels")
def bench_kernels(
    out: Path = typer.Option(Path("profiles/h200/kernels.csv"), "--out"),
    quick: bool = typer.Option(False, "--quick", help="A few points only."),
) -> None:
    """Benchmark the paged attention kernels against SDPA on contiguous KV (needs a GPU)."""
    try:
        import torch
    except ImportError:
        raise InputError("simkv bench kernels needs torch: pip install -e '.[gpu]'") from None
    if not torch.cuda.is_available():
        raise InputError("simkv bench kernels needs a CUDA GPU")
    run_kernel_bench = _require("simkv.gpu.bench", "run_kernel_bench", "bench kernels")
    run_kernel_bench(out, quick=quick, command="simkv bench kernels " + " ".join(sys.argv[3:]))


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"{option}: {text!r} is not a comma-separated list of integers") from None


@app.command("validate")
def validate(
    scenario: Path = typer.Argument(..., help="Validation scenario YAML."),
    device: str = typer.Option("cuda", "--device", help="cuda | cpu"),
    out: Optional[Path] = typer.Option(None, "--out", help="Where measurements and results go."),
    measured: Optional[Path] = typer.Option(None, "--measured",
                                            help="Compare a saved measurement (CPU side only)."),
    data: Optional[Path] = typer.Option(None, "--data", help="Folder of prepared trace windows."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when an error bound fails."),
) -> int:
    """Replay a scenario on the real engine, simulate it, and write the errors per metric."""
    if device not in ("cuda", "cpu"):
        raise InputError(f"--device: {device!r} is not one of cuda, cpu")
    validate_command = _require("simkv.validate", "validate_command", "validate")
    return validate_command(scenario, device=device, out_dir=out, measured_dir=measured,
                            data_dir=data, strict=strict)




# ----------------------------------------------------------------------------------------------
# Entry point


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def run_cli(argv: Optional[list[str]] = None) -> int:
    """Run the CLI on `argv` (default sys.argv[1:]) and return the exit code.

    Bad input never raises: InputError, missing files, bad YAML and bad parameters print one
    `error: ...` line on stderr and return 2.
    """
    import yaml

    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="simkv", standalone_mode=False)
        return code if isinstance(code, int) else 0
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 130
    except InputError as e:
        return _fail(str(e))
    except yaml.YAMLError as e:
        return _fail(f"bad YAML: {e}")
    except OSError as e:  # FileNotFoundError, IsADirectoryError, PermissionError, ...
        if e.filename is not None:
            return _fail(f"{e.strerror or e}: {e.filename}")
        return _fail(str(e))
    except Exception as e:
        # Usage errors of the parser (click's, or the copy vendored by newer typer versions).
        kinds = {cls.__name__ for cls in type(e).__mro__}
        if "NoArgsIsHelpError" in kinds:
            print(e.ctx.get_help())
            return 0
        if "ClickException" not in kinds:
            raise
        message = e.format_message()
        ctx = getattr(e, "ctx", None)
        if ctx is not None and ctx.command_path != "simkv":
            message = f"{ctx.command_path}: {message}"
        return _fail(message)


def _fail(message: str) -> int:
    print(f"error: {_one_line(message)}", file=sys.stderr)
    return EXIT_BAD_INPUT


def main() -> None:
    """Console-script entry point: `simkv ...`."""
    sys.exit(run_cli())


if __name__ == "__main__":
    main()
