"""`simkv validate`: the simulator against the real engine on the same requests (simkv.validate).

    simkv validate SCENARIO [--device D] [--out DIR] [--measured DIR]   measure, then compare
    simkv validate SCENARIO --engine vllm [--data DIR] [--out DIR]  measure on vLLM (GPU side)
    simkv validate prepare SCENARIO... [--data DIR]           trace windows for the GPU machine
    simkv validate measure SCENARIO... [--data DIR] [--out DIR]     GPU side (no simpy)
    simkv validate compare SCENARIO --measured DIR [--out JSON]     CPU side
    simkv validate diagnostics RESULT.json... [--split]             served-step error per result
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from simkv.cli.common import call_main, check_device, require, with_default_command

validate_app = typer.Typer(
    cls=with_default_command("run"), no_args_is_help=True,
    help="Compare the simulator with the real engine on the same requests. "
         "`simkv validate SCENARIO ...` is short for `simkv validate run SCENARIO ...`.")


@validate_app.command("run")
def validate_run(
    scenario: Path = typer.Argument(..., help="Validation scenario YAML."),
    device: str = typer.Option("cuda", "--device", help="cuda | cpu"),
    out: Optional[Path] = typer.Option(None, "--out", help="Where measurements and results go."),
    measured: Optional[Path] = typer.Option(None, "--measured",
                                            help="Compare a saved measurement (CPU side only)."),
    data: Optional[Path] = typer.Option(None, "--data", help="Folder of prepared trace windows."),
    strict: bool = typer.Option(False, "--strict", help="Exit 1 when an error bound fails."),
    engine: str = typer.Option("simkv", "--engine",
                               help="simkv (the project's engine) | vllm (a vLLM installed "
                                    "here serves the requests; measures only, into "
                                    "OUT/<name>/, default OUT results/vllm)"),
) -> int:
    """Replay a scenario on the real engine, simulate it, and write the errors per metric."""
    if engine == "vllm":
        return _validate_on_vllm(scenario, out, data)
    if engine != "simkv":
        from simkv.errors import InputError
        raise InputError(f"--engine: {engine!r} is not one of simkv, vllm")
    check_device(device)
    validate_command = require("simkv.validate", "validate_command", "validate")
    return validate_command(scenario, device=device, out_dir=out, measured_dir=measured,
                            data_dir=data, strict=strict)


def _validate_on_vllm(scenario: Path, out: Optional[Path], data: Optional[Path]) -> int:
    """vLLM serves the scenario saturated, then in real time (simkv.gpu.vllm.driver)."""
    import importlib.util
    import sys

    from simkv.errors import InputError

    if importlib.util.find_spec("vllm") is None:
        raise InputError("--engine vllm: vLLM is not installed here (it needs a GPU machine; "
                         "scripts/vllm_device/README.md says how to bring it to the H200)")
    if not scenario.is_file():
        raise InputError(f"{scenario}: no such scenario file")
    measure_vllm = require("simkv.gpu.vllm.driver", "measure_vllm", "validate --engine vllm")
    from simkv.validation.data import load_validation_scenario, requests_fingerprint
    from simkv.workload.frames import load_requests_frame
    scn = load_validation_scenario(scenario, data)
    name, frame = scn.name, load_requests_frame(scn)
    requests_meta = {      # what `validate compare` checks the scenario's requests against
        "scenario_path": str(scenario), "requests": len(frame),
        "arrival_span_s": float(frame["arrival_s"].max() - frame["arrival_s"].min()),
        "requests_sha256": requests_fingerprint(frame),
        "requests_sha256_no_arrivals": requests_fingerprint(frame, arrivals=False)}
    folder = measure_vllm(scn, frame, (out or Path("results/vllm")) / name,
                          requests_meta=requests_meta)
    print(f"[validate] vLLM measured {name} -> {folder}; compare on a CPU with simpy: "
          f"simkv validate compare {scenario} --measured {folder} --out RESULT.json",
          file=sys.stderr)
    return 0


@validate_app.command("prepare")
def validate_prepare(
    scenarios: list[Path] = typer.Argument(..., help="Validation scenario YAMLs."),
    data: Path = typer.Option(Path(".valdata"), "--data",
                              help="Folder the trace windows go to (travels with the repo)."),
) -> int:
    """Write each scenario's requests as a canonical CSV, for a machine without the traces."""
    prepare_command = require("simkv.validate", "prepare_command", "validate prepare")
    return prepare_command([str(p) for p in scenarios], str(data))


@validate_app.command("measure")
def validate_measure(
    scenarios: list[Path] = typer.Argument(..., help="Validation scenario YAMLs."),
    data: Optional[Path] = typer.Option(None, "--data", help="Folder of prepared trace windows."),
    out: Path = typer.Option(Path("results/validation"), "--out",
                             help="Each measurement goes to OUT/<name>/."),
    device: str = typer.Option("cuda", "--device", help="cuda | cpu"),
    progress: bool = typer.Option(False, "--progress", help="Show the engine's progress."),
    no_trace: bool = typer.Option(False, "--no-trace",
                                  help="Leave trace.csv (the served rows of a shared trace) out."),
    pin_cpu: Optional[int] = typer.Option(
        None, "--pin-cpu", metavar="N", help="Run pinned to CPU N (as a profile measured with "
                                             "--pin-cpu)."),
) -> int:
    """GPU side (no simpy needed): the engine serves each scenario saturated, then in real time."""
    measure_command = require("simkv.validate", "measure_command", "validate measure")
    return measure_command([str(p) for p in scenarios], str(out), device,
                           data_dir=None if data is None else str(data), progress=progress,
                           write_trace=not no_trace, pin_cpu=pin_cpu)


@validate_app.command("compare")
def validate_compare(
    scenario: Path = typer.Argument(..., help="Validation scenario YAML."),
    measured: Path = typer.Option(..., "--measured", help="A measurement folder (OUT/<name>)."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="JSON path (default profiles/<gpu>/<model>/validation/<name>.json)."),
    cost_model: Optional[str] = typer.Option(
        None, "--cost-model", help="The scenario's cost_model instead (auto | profile | roofline "
                                   "| a fit.json, e.g. a profile measured beside this "
                                   "measurement); needs --out."),
    gpu_clock: Optional[str] = typer.Option(
        None, "--gpu-clock", help="The scenario's gpu_clock instead: auto | fixed (no "
                                  "clock-state model); needs --out."),
    no_plots: bool = typer.Option(False, "--no-plots", help="Write the JSON only."),
    calibrate_saturated: bool = typer.Option(
        False, "--calibrate-saturated", help="Scale the step times so that the simulated "
        "all-at-zero run lasts as long as the measured saturated run, then compare; needs --out."),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a scenario key: KEY=VALUE (repeatable), e.g. "
        "scheduler.admission_delay_s (the request path, docs/semantics.md); needs --out."),
) -> int:
    """CPU side: the simulator serves the measured requests; errors per metric, plots, JSON."""
    from simkv.errors import InputError

    if gpu_clock not in (None, "auto", "fixed"):
        raise InputError(f"--gpu-clock: {gpu_clock!r} is not one of auto, fixed")
    compare_command = require("simkv.validate", "compare_command", "validate compare")
    return compare_command(str(scenario), str(measured), None if out is None else str(out),
                           cost_model=cost_model, gpu_clock=gpu_clock,
                           calibrate=calibrate_saturated, plots=not no_plots, set_=set_)


@validate_app.command("diagnostics")
def validate_diagnostics(
    results: list[Path] = typer.Argument(..., help="Validation result JSONs (of `simkv "
                                         "validate compare`)."),
    split: bool = typer.Option(
        False, "--split", help="Instead: per result, the measured real-time run's decode-only "
        "steps split into device, host input preparation and host time outside the executor "
        "(ms per step; read from the result's measured_dir)."),
) -> int:
    """The served-step error of validation results (real-time runs) and their mean."""
    main = require("simkv.validation.diagnostics", "main", "validate diagnostics")
    return call_main(main, [*(["--split"] if split else []), *map(str, results)])
