#!/usr/bin/env bash
# Issue 31's H200 runs for the mixture-of-experts model, from the repository root on the device
# machine (nvidia-h200; carry .valdata: `simkv validate prepare
# scenarios/validation/azure-conv-qwen3-30b-a3b-bs16.yaml --data .valdata` first, here):
#   bash scripts/prof_device/run.sh validate run1   # the validation scenario on the engine
#   bash scripts/prof_device/run.sh profile         # the profile (at most ~8 minutes)
#   bash scripts/prof_device/run.sh validate run2   # again, minutes after run1
# Each writes $OUT/<what>.tar.gz (the folders it measured; the device returns two folder levels)
# and $OUT/<what>.log. Where the results go in the repository: scripts/prof_device/README.md.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/prof-device}
MODEL=qwen3-30b-a3b
SCENARIO=scenarios/validation/azure-conv-qwen3-30b-a3b-bs16.yaml
what=${1:?usage: run.sh validate RUN | profile}
run=${2:-}
work="/tmp/prof-work/$what$run"     # outside $OUT: only the tar and the log come back
mkdir -p "$work"

header() {
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
}

validate() {   # RUN: the engine serves the scenario saturated, then by the wall clock
  timeout 500 python3 -m simkv.cli validate measure "$SCENARIO" --data .valdata \
    --out "$work/validation" --no-trace
  echo "measure $1 rc $? at $(date -u +%T)"
  mv "$work/validation/azure-conv-qwen3-30b-a3b-bs16" "$work/validation/$1"
}

{
  header
  case "$what" in
    validate) validate "${run:?validate needs RUN (run1 or run2)}" ;;
    profile)
      # the profile: block size 16 first (the validation's), 64 if the budget leaves room;
      # steps, the rested steps (the clock model), the engine pass, transfers and the ledger; the
      # fit is made on the CPU afterwards
      timeout 560 python3 -m simkv.gpu.profiler --model "$MODEL" --block-sizes 16,64 \
        --time-budget-s 400 --parts steps,rested,transfers,ledger,engine --out "$work/$MODEL"
      echo "profile rc $? at $(date -u +%T)" ;;
    *) echo "unknown run $what"; exit 2 ;;
  esac
} 2>&1 | tee "$OUT/$what$run.log"
tar -C "$work" -czf "$OUT/$what$run.tar.gz" .
