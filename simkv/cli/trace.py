"""`simkv trace stats|convert`: inspect request traces and convert them to the canonical CSV."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from simkv.cli.common import TRACE_FORMATS, console, fmt, print_json, require
from simkv.errors import InputError

trace_app = typer.Typer(help="Inspect request traces and convert them to the canonical CSV.",
                        no_args_is_help=True)


def _check_format(trace_format: str) -> None:
    if trace_format not in TRACE_FORMATS:
        raise InputError(f"--format: {trace_format!r} is not one of {', '.join(TRACE_FORMATS)}")


@trace_app.command("stats")
def trace_stats(
    path: Path = typer.Argument(..., help="Trace file."),
    trace_format: str = typer.Option("auto", "--format", help="auto|azure|mooncake|burstgpt|csv"),
    offset: int = typer.Option(0, "--offset", help="Skip the first N requests."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Keep N requests (after --offset)."),
    model: list[str] = typer.Option([], "--model", help="BurstGPT: keep this Model's rows (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print the statistics as JSON."),
) -> None:
    """Request count, duration, rate and token-length percentiles of a trace (or a window)."""
    _check_format(trace_format)
    load_trace = require("simkv.workload.traces", "load_trace", "trace stats")
    stats_of = require("simkv.workload.traces", "trace_stats", "trace stats")
    stats = stats_of(load_trace(path, **_window(trace_format, offset, limit, model)))
    if as_json:
        print_json(stats)
        return
    from rich.table import Table

    table = Table(title=str(path), show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in _flatten(stats).items():
        table.add_row(key, fmt(value))
    console().print(table)


def _window(trace_format: str, offset: int, limit: Optional[int], model: list[str]) -> dict:
    if offset < 0:
        raise InputError(f"--offset: must be >= 0, got {offset}")
    if limit is not None and limit < 1:
        raise InputError(f"--limit: must be >= 1, got {limit}")
    return {"format": trace_format, "offset": offset, "limit": limit,
            "model_filter": list(model) or None}


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
    trace_format: str = typer.Option("auto", "--format", help="auto|azure|mooncake|burstgpt|csv"),
    offset: int = typer.Option(0, "--offset", help="Skip the first N requests."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Keep N requests (after --offset)."),
    model: list[str] = typer.Option([], "--model", help="BurstGPT: keep this Model's rows (repeatable)."),
) -> None:
    """Convert a trace (or a window of it) to the canonical CSV (arrival_s, prompt_tokens, ...)."""
    _check_format(trace_format)
    load_trace = require("simkv.workload.traces", "load_trace", "trace convert")
    write_canonical = require("simkv.workload.traces", "write_canonical", "trace convert")
    df = load_trace(path, **_window(trace_format, offset, limit, model))
    write_canonical(df, out)
    console().print(f"wrote {len(df):,} requests to {out}")
