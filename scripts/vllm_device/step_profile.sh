#!/bin/bash
# On the H200 machine, once the carry is complete (README.md): vLLM's own step times for
# controlled compositions (simkv/gpu/vllm/step_profile.py), one engine with the validation
# scenarios' settings, into $OUT/step-profile/raw.json with a log beside it.
#   bash scripts/vllm_device/step_profile.sh SECONDS [BUDGET_S]
# SECONDS: the hard limit; BUDGET_S: no phase starts after this (default SECONDS - 120).
set -o pipefail
limit=$1; budget=${2:-$(( $1 - 120 ))}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/step-profile"
export PYTHONPATH=/root/vllm-site:$PWD PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm \
    --format=csv,noheader
t0=$(date +%s)
timeout "$limit" python3 -m simkv.gpu.vllm.step_profile measure \
    scenarios/validation/bursty-cancel-n2-bs16.yaml --out "$OUT/step-profile" \
    --budget-s "$budget" 2>&1 | tee "$OUT/step-profile.log" | grep -v -E "INFO.*Avg"
echo "[step-profile] exit $? after $(( $(date +%s) - t0 )) s"
