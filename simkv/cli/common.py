"""What the command groups share: lazy module look-up, number formatting, JSON and summaries.

Nothing here imports pandas, simpy or torch: `simkv --help` must work on the GPU machine,
which has no simpy, and stay fast everywhere.
"""
from __future__ import annotations

import argparse
import json
import numbers
from typing import Any, Callable

from typer.core import TyperGroup

from simkv.errors import InputError

TRACE_FORMATS = ("auto", "azure", "mooncake", "burstgpt", "csv")
GIB = 1 << 30
MIB = 1 << 20


def not_available(command: str, detail: str = "") -> InputError:
    return InputError(f"simkv {command} is not available yet{detail}")


def require(module: str, attr: str, command: str) -> Any:
    """`module.attr`, or InputError 'not available yet' if that module is not written yet."""
    import importlib

    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as e:
        # Missing simkv modules are work in progress; a missing third-party package is not.
        if e.name is not None and e.name.split(".")[0] == "simkv":
            raise not_available(command, f" (needs {e.name})") from None
        raise
    if not hasattr(found, attr):
        raise not_available(command, f" (needs {module}.{attr})")
    return getattr(found, attr)


def require_first(candidates: list[tuple[str, str]], command: str) -> Any:
    """The first `module.attr` of `candidates` that exists (a module may be moving)."""
    for module, attr in candidates[:-1]:
        try:
            return require(module, attr, command)
        except InputError:
            continue
    return require(*candidates[-1], command)


def call_main(main: Callable[..., int], argv: list[str], **kwargs: Any) -> int:
    """Run a module's argparse `main(argv, **kwargs)` and return its exit code.

    The flags were already parsed by the `simkv` command, so only the module's own checks can
    reject them (`parser.error`); those become InputError, i.e. one `error: ...` line and exit 2,
    instead of argparse's usage text.
    """
    def one_line_error(parser, message):
        raise InputError(message)

    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = one_line_error
    try:
        code = main(argv, **kwargs)
    finally:
        argparse.ArgumentParser.error = original
    return int(code or 0)


def with_default_command(default: str) -> type[TyperGroup]:
    """A command group whose arguments go to its command `default` when the first names none of
    its commands: `simkv fit DIR` is `simkv fit profile DIR`, beside `simkv fit clock ...`."""

    class GroupWithDefault(TyperGroup):
        def parse_args(self, ctx, args):
            if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
                args = [default, *args]
            return super().parse_args(ctx, args)

    return GroupWithDefault


def console():
    from rich.console import Console

    return Console()


def fmt(value: Any) -> str:
    """A number for a table: thousands separators, four significant digits below 10,000."""
    if value is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    if isinstance(value, numbers.Real):
        value = float(value)
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value)


def print_json(data: Any) -> None:
    def plain(value: Any) -> Any:  # numpy scalars, paths
        return value.item() if hasattr(value, "item") else str(value)

    print(json.dumps(data, indent=2, default=plain))


def int_list(text: str, option: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"{option}: {text!r} is not a comma-separated list of integers") from None


def check_device(device: str) -> None:
    if device not in ("cuda", "cpu"):
        raise InputError(f"--device: {device!r} is not one of cuda, cpu")


def flag(name: str, value: Any) -> list[str]:
    """`[name, str(value)]` for an option that was given, `[]` for one left at None."""
    return [] if value is None else [name, str(value)]


def print_warnings(summary: dict[str, Any]) -> None:
    """The run's `warnings` (what was changed in the input instead of refused), one
    `warning: ...` line each on stderr."""
    import sys

    for line in summary.get("warnings") or []:
        print(f"warning: {line}", file=sys.stderr)


def show_progress() -> bool:
    """Progress bars only on a terminal (stderr), never into a pipe or a log."""
    import sys

    return sys.stderr.isatty()


def print_summary(summary: dict[str, Any], title: str) -> None:
    """A run's summary as two tables: the scalars, then the {mean,p50,p90,p99} families."""
    from rich.table import Table

    scalars = Table(title=title, show_header=False)
    scalars.add_column(style="bold")
    scalars.add_column(justify="right")
    latencies = Table(title="latency and per-step distributions")
    latencies.add_column("metric", style="bold")
    for stat in ("mean", "p50", "p90", "p99"):
        latencies.add_column(stat, justify="right")
    for key, value in summary.items():
        if key in ("provenance", "warnings"):   # provenance: its caveats after the tables
            # (print_caveats); warnings: on stderr (print_warnings)
            continue
        if isinstance(value, dict):
            latencies.add_row(key, *(fmt(value.get(s)) for s in ("mean", "p50", "p90", "p99")))
        else:
            scalars.add_row(key, fmt(value))
    out = console()
    out.print(scalars)
    if latencies.row_count:
        out.print(latencies)

