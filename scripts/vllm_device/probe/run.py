"""Pause probe's driver: `simkv validate ...` (argv as for simkv) with, in the driver process,
each pass's clock origin, an event-loop lag monitor and stacks of the busy main thread, into
PAUSE_PROBE_DIR/probe-<pid>.log (sitecustomize.py). With PROBE_GC_FREEZE=1, before each pass
gc.collect() then gc.freeze() (as `vllm serve` freezes its heap after start-up).
  loop lag ...  the event loop woke over 30 ms late for a 5 ms sleep
  dstack ...    the driver's main thread stack while the loop has not turned for over 60 ms
"""
import asyncio
import gc
import os
import sys
import threading
import time

from sitecustomize import stack_of, write

import simkv.gpu.vllm.driver as driver

_original = driver._run_pass
_beat = {"t": None, "main": threading.get_ident()}


def _sampler():
    while True:
        time.sleep(0.02)
        b = _beat["t"]
        now = time.perf_counter()
        if b is not None and now - b > 0.060:
            write(f"dstack t={now:.6f} loop_still_ms={(now - b) * 1e3:.0f} "
                  f"{stack_of(_beat['main'], 14)}")


async def _monitor(name):
    while True:
        t = time.perf_counter()
        _beat["t"] = t
        await asyncio.sleep(0.005)
        late = time.perf_counter() - t - 0.005
        if late > 0.030:
            write(f"loop lag pass={name} from={t:.6f} late_ms={late * 1e3:.1f}")


async def _run_pass(engine, sink, requests, pass_name, realtime):
    if os.environ.get("PROBE_GC_FREEZE") == "1":
        t = time.perf_counter()
        gc.collect()
        gc.freeze()
        write(f"freeze before {pass_name}: {(time.perf_counter() - t) * 1e3:.0f} ms, "
              f"{gc.get_freeze_count()} objects frozen")
    write(f"pass {pass_name} begins {time.perf_counter():.6f} tracked={len(gc.get_objects())}")
    task = asyncio.ensure_future(_monitor(pass_name))
    try:
        result = await _original(engine, sink, requests, pass_name, realtime)
    finally:
        task.cancel()
        _beat["t"] = None
    write(f"pass {pass_name} t0={sink.t0:.6f} ends {time.perf_counter():.6f}")
    return result


driver._run_pass = _run_pass
threading.Thread(target=_sampler, daemon=True, name="pause-probe-driver").start()

from simkv.cli import main  # noqa: E402

sys.argv = ["simkv", *sys.argv[1:]]
main()
