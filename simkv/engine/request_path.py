"""The request-path term's keys (docs/semantics.md, "The request path"), read without the
simulator: the GPU engine, which refuses them, runs where SimPy is not installed."""
from __future__ import annotations

from simkv.errors import InputError


def refuse_request_path(scenario, where: str) -> None:
    """InputError when `scenario` sets a request-path delay that `where` does not apply."""
    path = request_path(scenario.scheduler)
    if path:
        key = next(k for k, v in path.items() if v)
        raise InputError(f"scheduler.{key}: {where} does not model the request path "
                         "(docs/semantics.md); set it to 0")


def request_path(sched) -> dict | None:
    """The scenario's request-path term (docs/semantics.md, "The request path"), None when it
    has none (every delay 0)."""
    keys = ("admission_delay_s", "output_delay_s", "output_delay_per_running_s")
    values = {k: float(getattr(sched, k)) for k in keys}
    return values if any(values.values()) else None
