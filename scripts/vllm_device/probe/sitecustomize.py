"""Pause probe (scripts/vllm_device/pause_probe.sh): loaded by every Python process whose
PYTHONPATH holds this folder (the driver and vLLM's engine core), active when PAUSE_PROBE_DIR
is set. Writes PAUSE_PROBE_DIR/probe-<pid>.log, times on time.perf_counter() (CLOCK_MONOTONIC,
one clock for all processes):
  gc ...      every generation-2 collection, and any other one over 10 ms (gc.callbacks)
  core ...    in vLLM's engine core: a step (EngineCoreProc._process_engine_step) that starts
              over 50 ms after the one before or lasts over 50 ms; a beat every 2000 steps
  stack ...   in the engine core, the busy thread's stack while one step has run over 60 ms
Caveat, as measured: gc.get_freeze_count() walks the frozen list; with 0.8 M objects frozen
(PROBE_GC_FREEZE=1) each logged gen-2 collection then stalls the driver ~75 ms more than the
collection itself (the 87-99 ms loop lags of freeze-driver.log against 14-23 ms collections).
"""
import gc
import os
import sys
import threading
import time

DIR = os.environ.get("PAUSE_PROBE_DIR")
_files = {}


def write(line):
    pid = os.getpid()
    f = _files.get(pid)
    if f is None:
        f = _files[pid] = open(os.path.join(DIR, f"probe-{pid}.log"), "a", buffering=1)
        f.write(f"# pid {pid} ppid {os.getppid()} argv {sys.argv[:3]!r} "
                f"at {time.perf_counter():.6f}\n")
    f.write(line + "\n")


def stack_of(ident, depth=8):
    frame = sys._current_frames().get(ident)
    out = []
    while frame is not None and len(out) < depth:
        c = frame.f_code
        out.append(f"{c.co_name}@{os.path.basename(c.co_filename)}:{frame.f_lineno}")
        frame = frame.f_back
    return " < ".join(out)


_gc_start = {}


def _gc_callback(phase, info):
    now = time.perf_counter()
    if phase == "start":
        _gc_start[os.getpid()] = now
        return
    t = _gc_start.pop(os.getpid(), None)
    if t is None:
        return
    d = now - t
    if info["generation"] == 2 or d > 0.010:
        write(f"gc gen={info['generation']} start={t:.6f} dur_ms={d * 1e3:.2f} "
              f"collected={info['collected']} frozen={gc.get_freeze_count()} "
              f"counts={gc.get_count()}")


def _patch_core(module):
    cls = module.EngineCoreProc
    original = cls._process_engine_step
    state = {"prev": None, "n": 0, "in_step": None, "ident": None}

    def sampler():
        while True:
            time.sleep(0.02)
            since = state["in_step"]
            if since is not None and time.perf_counter() - since > 0.060:
                write(f"stack t={time.perf_counter():.6f} in_step_ms="
                      f"{(time.perf_counter() - since) * 1e3:.0f} {stack_of(state['ident'], 14)}")

    def wrapped(self):
        t = time.perf_counter()
        if state["ident"] is None:
            state["ident"] = threading.get_ident()
            threading.Thread(target=sampler, daemon=True, name="pause-probe").start()
            write(f"core first step at {t:.6f}")
        state["in_step"] = t
        try:
            return original(self)
        finally:
            e = time.perf_counter()
            state["in_step"] = None
            prev = state["prev"]
            state["n"] += 1
            if prev is not None and (t - prev[0] > 0.050 or e - t > 0.050):
                try:
                    sched = self.scheduler
                    queues = f"running={len(sched.running)} waiting={len(sched.waiting)}"
                except Exception:  # noqa: BLE001  (a probe never stops the engine)
                    queues = ""
                write(f"core step n={state['n']} start={t:.6f} dur_ms={(e - t) * 1e3:.2f} "
                      f"gap_from_prev_start_ms={(t - prev[0]) * 1e3:.2f} "
                      f"prev_dur_ms={(prev[1] - prev[0]) * 1e3:.2f} "
                      + queues)
            if state["n"] % 2000 == 0:
                write(f"core beat n={state['n']} at {t:.6f}")
            state["prev"] = (t, e)

    cls._process_engine_step = wrapped
    write("core patched EngineCoreProc._process_engine_step")


class _CoreHook:
    """Patches vllm.v1.engine.core once it is loaded (in whichever process loads it)."""

    def find_spec(self, name, path, target=None):
        if name != "vllm.v1.engine.core":
            return None
        import importlib.util
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch_core(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if DIR:
    gc.callbacks.append(_gc_callback)
    sys.meta_path.insert(0, _CoreHook())
