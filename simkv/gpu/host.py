"""Host-side conditions of a timed run: Python's garbage collector and the CPU the process runs on.

A step that launches its kernels from Python (an eager step of a small model: 1.5-3 ms of
device work behind ~8 ms of launches) is as slow as the host. Two host effects were measured on
the H200's machine (research/eager_noise.py, a 1B's eager steps of 1,084-2,048 tokens):

- a garbage collection started by the forward's short-lived tensors, traversing every object
  the process holds, stalls the launches: medians 11-15 ms with collections against 8.7-13 ms
  without, p90 up to 1.8x the median. `GpuExecutor.execute` therefore holds automatic collection
  off for a step (pending collections run after it, in the engine's time between steps), and
  `frozen_heap()` moves everything alive at the start of a run out of the collector's reach, so
  that the collections that do run are short;
- the process moving between CPUs: pinned to one CPU, the profile's graphed steps' p10-p90
  spread fell from 11% to 6% and the eager steps' from 47% to 21% (`pin_to_cpu`; the profiler
  and the validation engine take `--pin-cpu`, and record it in their metadata).
"""
from __future__ import annotations

import contextlib
import gc
import os
import subprocess

from simkv.errors import InputError


@contextlib.contextmanager
def frozen_heap():
    """Collect once, then keep every object alive now out of later collections (gc.freeze) for
    the duration; unfreezes afterwards. Only the outermost of nested uses freezes and unfreezes
    (gc.unfreeze releases everything frozen), and a heap the caller froze before is left so."""
    if _frozen["depth"] or gc.get_freeze_count():
        _frozen["depth"] += 1
        try:
            yield
        finally:
            _frozen["depth"] -= 1
        return
    gc.collect()
    gc.freeze()
    _frozen["depth"] = 1
    try:
        yield
    finally:
        _frozen["depth"] = 0
        gc.unfreeze()


_frozen = {"depth": 0}


@contextlib.contextmanager
def collection_held():
    """Automatic garbage collection off inside (restored to its previous state on exit)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def pin_to_cpu(cpu: int | None) -> None:
    """Pin this process to one CPU (`cpu`; None leaves it as it is). A CPU outside the
    process's allowed set is an InputError. Call it first: on Linux it pins the calling thread,
    and threads started later (CUDA's, OpenMP's) inherit the CPU; ones already running do not."""
    if cpu is None:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise InputError(f"--pin-cpu {cpu}: this system cannot pin a process to a CPU")
    allowed = os.sched_getaffinity(0)
    if cpu not in allowed:
        raise InputError(f"--pin-cpu {cpu}: this process may run on CPUs {sorted(allowed)}")
    os.sched_setaffinity(0, {cpu})


def host_conditions() -> dict:
    """For metadata: the CPUs this process may run on (`pinned_cpu` when it is one), and how
    the timed code treats the garbage collector."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {"pinned_cpu": cpus[0] if len(cpus) == 1 else None,     # or a one-CPU container
            "cpus_allowed": len(cpus) or os.cpu_count(),
            "gc": "collection held off inside each step; the heap alive before a run frozen"}


SMI_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


@contextlib.contextmanager
def nvidia_smi_log(path, fields: str = SMI_FIELDS, interval_ms: int = 100):
    """Log nvidia-smi's `fields` to the CSV `path` every `interval_ms` while the block runs
    (nothing where nvidia-smi is absent); stopped on any exit."""
    try:
        out = open(path, "w")
    except OSError:
        out = None
    smi = None
    if out is not None:
        try:
            smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,nounits",
                                    "-lms", str(interval_ms)], stdout=out,
                                   stderr=subprocess.DEVNULL)
        except OSError:
            smi = None
    try:
        yield
    finally:
        if smi is not None:
            smi.terminate()
            smi.wait()
        if out is not None:
            out.close()
