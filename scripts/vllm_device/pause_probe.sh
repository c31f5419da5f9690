#!/bin/bash
# On the H200 machine, the carry complete (README.md): one scenario as measure.sh runs it, with the
# pause probe (probe/): gc, engine-core step gaps, driver event-loop lag and stacks, TORCH_LOGS.
#   bash scripts/vllm_device/pause_probe.sh SECONDS SCENARIO.yaml [TAG]   (PROBE_GC_FREEZE=1: fix)
set -o pipefail
limit=$1; scenario=$2; tag=${3:-probe}
OUT=${OUT:-/tmp/out}; P=$OUT/$tag; mkdir -p "$P" /tmp/vllm-results
export PYTHONPATH=/root/vllm-site:$PWD/scripts/vllm_device/probe:$PWD PYTHONUNBUFFERED=1 \
       VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       PAUSE_PROBE_DIR=$P TORCH_LOGS=recompiles,graph_breaks
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$P/gpu.txt"
name=$(basename "$scenario" .yaml); t0=$(date +%s)
timeout "$limit" python3 scripts/vllm_device/probe/run.py validate "$scenario" --engine vllm \
    --data .valdata --out /tmp/vllm-results/$tag 2>&1 | tee "$P/$name.log" \
    | grep -v -E "^\(EngineCore.*INFO.*Avg" | tail -25
echo "[probe] $name: exit $? after $(( $(date +%s) - t0 )) s"
rm -f /tmp/vllm-results/$tag/*/*/records.json.gz
tar -czf "$P/results.tar.gz" -C /tmp/vllm-results/$tag --exclude=records.json .
ls -la "$P"; grep -h -E "^(gc gen=2|core step|loop lag|pass|freeze)" "$P"/probe-*.log | head -60
