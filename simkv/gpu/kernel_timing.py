"""Timing machinery of the kernel benchmark: per-call and steady-state device time on one CUDA GPU.

* `time_us`: one call captured in a CUDA graph, its replays timed by `triton.testing.do_bench`
  (CUDA events, L2 flushed before each replay, median). Each replay pays the graph's launch and a
  cold L2, so a small call shows a floor of several microseconds that is not the kernel's own.
* `steady_time_us`: calls back to back in ONE CUDA graph, cycling over input sets whose KV bytes
  together exceed `STEADY_MIN_BYTES` (`steady_sets` says how many), so that no call finds its KV in
  L2; the rate at which an engine replaying a graph of many layers runs the kernel.
"""

from __future__ import annotations

import math
import statistics
import sys
from typing import Callable

import torch

# Steady-state timing: calls per graph, and KV bytes the rotating input sets must span (twice
# an H200's 50 MB L2), with a cap on the number of sets.
STEADY_CALLS = 20
STEADY_MIN_BYTES = 100e6
STEADY_MAX_SETS = 16
STEADY_GRAPH_US = 20_000.0   # fewer calls per graph when one call is long


def time_us(fn, graph: bool = True) -> float:
    """Median time of one fn() call in microseconds.

    With `graph`, the call is captured once in a CUDA graph and the replays are timed, so the
    number is device time without Python/launch overhead (as in an engine that replays graphs).
    triton.testing.do_bench times each call with CUDA events and flushes the L2 cache before it.
    """
    import triton.testing

    run = fn
    if graph:
        fn()
        torch.cuda.synchronize()
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        except RuntimeError as e:  # not capturable: time it eagerly rather than not at all
            print(f"  graph capture failed, timing eagerly: {str(e).splitlines()[0][:100]}", file=sys.stderr)
            torch.cuda.synchronize()
    return triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median") * 1e3


def steady_sets(nbytes: float) -> int:
    """Input sets to rotate over so that their KV bytes together reach STEADY_MIN_BYTES."""
    return int(max(1, min(STEADY_MAX_SETS, math.ceil(STEADY_MIN_BYTES / max(nbytes, 1.0)))))


def steady_time_us(calls: list[Callable], per_call_hint_us: float | None = None) -> tuple[float, int]:
    """Per-call time (µs) of the calls run back to back, and how many calls the graph held.

    One CUDA graph holds K calls cycling over `calls` (one per input set; K = STEADY_CALLS, fewer
    for calls longer than STEADY_GRAPH_US / STEADY_CALLS, never fewer than the sets); its replays
    are timed with CUDA events, one replay per measurement, and the median is divided by K.
    """
    k = STEADY_CALLS
    if per_call_hint_us:
        k = min(k, max(3, math.ceil(STEADY_GRAPH_US / per_call_hint_us)))
    k = max(k, len(calls))
    for call in calls:  # compile, allocate, warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(k):
            calls[i % len(calls)]()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    reps, spent_ms = 3, 0.0
    while len(times) < reps:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        if len(times) == 3:  # first replays warm the graph; then ~0.1 s of replays, 5..50 of them
            spent_ms = statistics.median(times)
            reps = 3 + int(max(5, min(50, 100.0 / max(spent_ms, 1e-3))))
    del graph
    return statistics.median(times[3:]) * 1e3 / k, k
