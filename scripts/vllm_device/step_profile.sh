#!/bin/bash
# On the H200 machine, once the carry is complete (README.md): vLLM's own step times for
# controlled compositions (simkv/gpu/vllm/step_profile.py), one engine with the validation
# scenarios' settings, into $OUT/step-profile/raw.json with a log beside it.
#   bash scripts/vllm_device/step_profile.sh SECONDS [BUDGET_S [PHASES]]
# SECONDS: the hard limit; BUDGET_S: no phase starts after this (default SECONDS - 120);
# PHASES: profile (the profile's phases, the default) or mix (prompts in decode streams as a
# trace has them), into $OUT/step-profile[-mix]/.
set -o pipefail
limit=$1; budget=${2:-$(( $1 - 120 ))}; phases=${3:-profile}
dir=step-profile; [ "$phases" = profile ] || dir=step-profile-$phases
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/$dir"
export PYTHONPATH=/root/vllm-site:$PWD PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.max.sm \
    --format=csv,noheader
t0=$(date +%s)
timeout "$limit" python3 -m simkv.gpu.vllm.step_profile measure \
    scenarios/validation/bursty-cancel-n2-bs16.yaml --out "$OUT/$dir" \
    --budget-s "$budget" --phases "$phases" 2>&1 | tee "$OUT/$dir.log" | grep -v -E "INFO.*Avg"
echo "[step-profile] exit $? after $(( $(date +%s) - t0 )) s"
