#!/usr/bin/env bash
# On the H200 machine, from the repository root: the window kernels' and the MoE stack's GPU
# checks and measurements (docs/profiling.md, "Sliding windows and experts"). Writes under $OUT:
# tests.log, window.csv + window.json, moe_step.json, run.log. About 5 minutes.
set -uo pipefail
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/moe-device}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  # correctness on the GPU: window kernels against the reference (NaN before each window), the
  # grouped expert GEMMs against the loop, the MoE engine against the plain model
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_window.py tests/test_moe_engine.py \
    > "$OUT/tests.log" 2>&1; echo "tests rc $?"; tail -3 "$OUT/tests.log"
  python3 -m simkv.gpu.bench window --out "$OUT/window.csv" --batch 64 --context 32768 --windows 1024 \
    --block-sizes 16; echo "window rc $?"
  python3 scripts/moe_device/moe_step.py --out "$OUT" --batch 64 --context 2048; echo "moe rc $?"
} 2>&1 | tee "$OUT/run.log"
