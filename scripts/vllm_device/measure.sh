#!/bin/bash
# On the H200 machine, once the carry is complete (README.md): vLLM serves each scenario, saturated
# then in real time, into /tmp/vllm-results/<name>/, packed as $OUT/results.tar.gz with a log per
# scenario. Each scenario gets a fresh engine (one process per scenario).
#   bash scripts/vllm_device/measure.sh SECONDS SCENARIO.yaml...   (SECONDS: limit per scenario)
set -o pipefail
limit=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/vllm-results
export PYTHONPATH=/root/vllm-site:$PWD PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
python3 -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch",
torch.__version__, "transformers", transformers.__version__)' 2>&1 | tail -2
for scenario in "$@"; do
    name=$(basename "$scenario" .yaml); t0=$(date +%s)
    timeout "$limit" python3 -m simkv.cli validate "$scenario" --engine vllm --data .valdata \
        --out /tmp/vllm-results 2>&1 | tee "$OUT/$name.log" | grep -v -E "^\(EngineCore.*INFO.*Avg"
    echo "[measure] $name: exit $? after $(( $(date +%s) - t0 )) s"
done
tar -czf "$OUT/results.tar.gz" -C /tmp/vllm-results .
