"""The `simkv` command line (typer). `python cli.py ...` and `python -m simkv.cli ...` are the same.

One module per command group: `run` (size, run), `trace`, `whatif` (sweep, capacity, check),
`fleet` (fleet, and a fleet run's terminal summary),
`gpu` (replay, profile, bench), `fit`, `validate`. Every bad input ends the same way: one line
`error: ...` on stderr and exit code 2, never a traceback (see `run_cli`). Heavy imports
(pandas, simpy, the simulator, torch) happen inside the commands, so that `simkv --help` stays
fast and the GPU-side commands (profile, replay, bench, validate measure) run without simpy.
"""
from __future__ import annotations

import sys
from typing import Optional

import typer

from simkv.cli import fit, fleet, gpu, run, trace, validate, whatif
from simkv.errors import InputError

app = typer.Typer(
    name="simkv",
    help="Capacity planning for LLM serving with a paged KV cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from simkv._version import __version__
        print(f"simkv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="Print simkv's version and exit.")) -> None:
    """Capacity planning for LLM serving with a paged KV cache."""


app.command("size")(run.size)
app.command("run")(run.run)
app.command("explain")(run.explain)
app.add_typer(trace.trace_app, name="trace")
app.command("sweep")(whatif.sweep)
app.command("capacity")(whatif.capacity)
app.command("check")(whatif.check)
app.command("fleet")(fleet.fleet)
app.command("replay")(gpu.replay)
app.command("profile")(gpu.profile)
app.add_typer(fit.fit_app, name="fit")
app.add_typer(gpu.bench_app, name="bench")
app.add_typer(validate.validate_app, name="validate")

EXIT_FAILED = 1      # a check or assertion failed
EXIT_BAD_INPUT = 2   # bad input: one line `error: ...` on stderr


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
        return _usage_error(e)


def _usage_error(e: Exception) -> int:
    """A usage error of the parser (click's, or the copy vendored by newer typer versions)."""
    kinds = {cls.__name__ for cls in type(e).__mro__}
    if "NoArgsIsHelpError" in kinds:
        # the error was made from ctx.get_help(), which typer's rich help prints as it is
        # asked (and returns ""); plain click returns the text: print it once either way
        if e.format_message().strip():
            print(e.format_message())
        return 0
    if "ClickException" not in kinds:
        raise e
    message = e.format_message()
    ctx = getattr(e, "ctx", None)
    if ctx is not None and ctx.command_path != "simkv":
        message = f"{ctx.command_path}: {message}"
    return _fail(message)


def _fail(message: str) -> int:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_BAD_INPUT


def main() -> None:
    """Console-script entry point: `simkv ...`."""
    sys.exit(run_cli())
