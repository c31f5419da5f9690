"""The profiling pass: the real executor over a designed grid of step compositions.

    python -m simkv.gpu.profiler --model llama-3.1-8b [--block-sizes 8,16,32,64,128] [--out DIR]
        [--parts steps,transfers,ledger,host_noise,engine[,rested][,serving]] [--time-budget-s S]
        [--quick] [--fit]

For each block size a fresh `GpuExecutor` (sample model, paged Triton kernels, CUDA graphs for
decode-only steps as the engine runs them) executes synthetic StepPlans:

- decode-only: batch x context, and heterogeneous contexts in one batch;
- prefill-only: chunk tokens x cached prefix, one or several chunks per step;
- mixed: prefill chunks beside decodes, as chunked prefill schedules them;
- block copies (copy-on-write) and host<->device swaps against blocks per transfer.

The step grid (`grid`) runs a warm-up round over the whole design, then `reps` rounds (at most 3
for steps over 50 ms), interleaved so that each composition is timed after different ones, as in
serving; the step time is the median of the executor's own CUDA-event span (`last_gpu_s`: host
input building, the forward, sampling and the copy of the sampled tokens back, as in the
engine); `prep_s` is the median host input building inside that span. The `rested` part (a
diagnostic, not in the default set) times each composition again after a short idle
(`rested_s`; `simkv fit` reports its ratio to the grid's times). The `serving` part (not in the
default set; with `engine`) serves a synthetic workload by the wall clock and keeps each step's
host terms (serving_host.csv, `simkv.gpu.engine_pass.measure_serving_host`). Block tables
are random permutations of the pool, whose K/V are random (never zeros). At block size 16 the
profiler also measures the memory ledger (`ledger`: weights, activation peak against batched
tokens, CUDA-graph pool and everything else) and repeats a few steps as they are and pinned to
one CPU (`host_noise`).

Writes `steps.csv`, `swap.csv`, `copy.csv`, `memory.csv`, `ledger.json`, `host_noise.csv` and
`meta.json` (GPU, driver, versions, clocks observed, date, command) under
`profiles/<gpu>/<model>/` (`output`, `meta`); `simkv fit` turns them into `fit.json`. Torch is
imported only when a profile runs, so the design grid (`simkv.profile.design`) is importable
anywhere. See docs/profiling.md.
"""
from simkv.gpu.profiler.command import main
from simkv.gpu.profiler.grid import (LONG_STEP_S, REST_S, RESTED_STEPS, STEP_FIELDS, _plan,
                                     _rested_seconds, _summary, _time, _tokens,
                                     profile_block_size, profiling_executor)
from simkv.gpu.profiler.host_noise import NOISE_IDS, measure_host_noise
from simkv.gpu.profiler.ledger import _estimate_comparison, measure_ledger
from simkv.gpu.profiler.meta import _meta, _nvidia_smi, gpu_short_name
from simkv.gpu.profiler.output import _write, _write_csv
from simkv.gpu.profiler.parts import GIB, LEDGER_BLOCK_SIZE, MAX_NUM_SEQS, OPTIONAL_PARTS, PARTS
from simkv.gpu.profiler.run import LEDGER_WARM_IDS, run_profile
from simkv.gpu.profiler.transfers import TRANSFER_FIELDS, profile_transfers

__all__ = [
    "GIB", "LEDGER_BLOCK_SIZE", "LEDGER_WARM_IDS", "LONG_STEP_S", "MAX_NUM_SEQS", "NOISE_IDS",
    "OPTIONAL_PARTS", "PARTS", "REST_S", "RESTED_STEPS", "STEP_FIELDS", "TRANSFER_FIELDS",
    "gpu_short_name", "main", "measure_host_noise", "measure_ledger", "profile_block_size",
    "profile_transfers", "profiling_executor", "run_profile",
    # used by the probes in benchmarks/
    "_estimate_comparison", "_meta", "_nvidia_smi", "_plan", "_rested_seconds", "_summary",
    "_time", "_tokens", "_write", "_write_csv",
]
