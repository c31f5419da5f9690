#!/usr/bin/env bash
# Issue 31's H200 runs (the mixture-of-experts model and the window hybrid), from the repository
# root on the device machine (nvidia-h200; carry .valdata: `simkv validate prepare SCENARIO
# --data .valdata` first, here):
#   bash scripts/prof_device/run.sh validate run1 [MODEL]   # the validation scenario on the engine
#   bash scripts/prof_device/run.sh profile [MODEL]         # the profile (at most ~8 minutes)
#   bash scripts/prof_device/run.sh validate run2 [MODEL]   # again, minutes after run1
# MODEL: qwen3-30b-a3b (the default; or $MODEL) or gemma-3-27b; the scenario is
# scenarios/validation/azure-conv-MODEL-bs16.yaml (or $SCENARIO).
# Each writes $OUT/<what>[-MODEL].tar.gz (the folders it measured; the device returns two folder
# levels) and $OUT/<what>[-MODEL].log (no suffix for the default model, as before). Where the
# results go in the repository: scripts/prof_device/README.md.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/prof-device}
what=${1:?usage: run.sh validate RUN [MODEL] | profile [MODEL]}
case "$what" in
  validate) run=${2:?validate needs RUN (run1 or run2)}; model_arg=${3:-} ;;
  *) run=""; model_arg=${2:-} ;;
esac
MODEL=${model_arg:-${MODEL:-qwen3-30b-a3b}}
SCENARIO=${SCENARIO:-scenarios/validation/azure-conv-$MODEL-bs16.yaml}
name=$(basename "$SCENARIO" .yaml)
suffix=$([ "$MODEL" = qwen3-30b-a3b ] || echo "-$MODEL")
work="/tmp/prof-work/$what$run$suffix"     # outside $OUT: only the tar and the log come back
mkdir -p "$work" "$OUT"
[ "$what" != validate ] || [ -f "$SCENARIO" ] || {
  echo "run.sh: no scenario $SCENARIO (set SCENARIO)"; exit 2; }

header() {
  date -u +%FT%TZ
  echo "model $MODEL, scenario $SCENARIO"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
}

validate() {   # RUN: the engine serves the scenario saturated, then by the wall clock
  timeout 500 python3 -m simkv.cli validate measure "$SCENARIO" --data .valdata \
    --out "$work/validation" --no-trace
  echo "measure $1 rc $? at $(date -u +%T)"
  mv "$work/validation/$name" "$work/validation/$1"
}

# the GPU's SM clock, power and throttle reasons every 250 ms while it runs (smi.csv in the tar):
# engine runs on different leases of the H200 differ by several percent (docs/validation.md)
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 250 > "$work/smi.csv" 2>&1 &
smi=$!
{
  header
  case "$what" in
    validate) validate "$run" ;;
    profile)
      # the profile: block size 16 first (the validation's), 64 if the budget leaves room;
      # steps, the rested steps (the clock model), the engine pass, transfers and the ledger; the
      # fit is made on the CPU afterwards
      # (BLOCK_SIZES, PARTS: other choices, e.g. PARTS=...,engine,serving for the serving pass)
      timeout 560 python3 -m simkv.gpu.profiler --model "$MODEL" --block-sizes "${BLOCK_SIZES:-16,64}" \
        --time-budget-s 400 --parts "${PARTS:-steps,rested,transfers,ledger,engine}" --out "$work/$MODEL"
      echo "profile rc $? at $(date -u +%T)" ;;
    *) echo "unknown run $what"; exit 2 ;;
  esac
} 2>&1 | tee "$OUT/$what$run$suffix.log"
kill "$smi" 2>/dev/null
# beside what it logged: the run's folder, or the profile's
if [ "$what" = validate ] && [ -d "$work/validation/$run" ]; then mv "$work/smi.csv" "$work/validation/$run/"
elif [ -d "$work/$MODEL" ]; then mv "$work/smi.csv" "$work/$MODEL/"; fi
tar -C "$work" -czf "$OUT/$what$run$suffix.tar.gz" .
