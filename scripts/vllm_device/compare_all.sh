#!/bin/bash
# On the CPU: every committed vLLM measurement against simkv, (a) the bundled H200 profile as is,
# (b) calibrated by vLLM's saturated run of the same requests and (c) with vLLM's own step
# profile (step-profile/fit.json, where it exists), written to
#   profiles/h200/llama-3.1-8b/vllm-0.26/compare/bundled/<name>-run<k>.json
#   profiles/h200/llama-3.1-8b/vllm-0.26/compare/calibrated/<name>-run<k>.json
#   profiles/h200/llama-3.1-8b/vllm-0.26/compare/vllm-profile/<name>-run<k>.json
# and (c) again with the request path's delays (PATH_SET: the values that path.py measures from
# the step profile's mix phases and the drivers' sent_s, never from a TTFT):
#   profiles/h200/llama-3.1-8b/vllm-0.26/compare/vllm-profile-path/<name>-run<k>.json
# then the table of docs/validation.md from those files (table.py).
#   bash scripts/vllm_device/compare_all.sh [RUN_DIR...]   (default: every <name>/run<k>/)
set -euo pipefail
V=profiles/h200/llama-3.1-8b/vllm-0.26
runs=("$@")
[ ${#runs[@]} -gt 0 ] || runs=($(ls -d $V/*/run*/ | sed 's:/$::'))
FIT=$V/step-profile/fit.json
# python scripts/vllm_device/path.py prints these (docs/validation.md, "The request path")
PATH_SET=(--set scheduler.admission_delay_s=0.00184 --set scheduler.output_delay_s=0.00130
          --set scheduler.output_delay_per_running_s=0.0000257)
mkdir -p $V/compare/bundled $V/compare/calibrated
[ -f $FIT ] && mkdir -p $V/compare/vllm-profile $V/compare/vllm-profile-path
for run in "${runs[@]}"; do
    name=$(basename "$(dirname "$run")"); k=$(basename "$run")
    scenario=scenarios/validation/$name.yaml
    simkv validate compare $scenario --measured $run --no-plots \
        --out $V/compare/bundled/$name-$k.json
    simkv validate compare $scenario --measured $run --no-plots --calibrate-saturated \
        --out $V/compare/calibrated/$name-$k.json
    if [ -f $FIT ]; then
        simkv validate compare $scenario --measured $run --no-plots --cost-model $FIT \
            --out $V/compare/vllm-profile/$name-$k.json
        simkv validate compare $scenario --measured $run --no-plots --cost-model $FIT \
            "${PATH_SET[@]}" --out $V/compare/vllm-profile-path/$name-$k.json
    fi
done
python scripts/vllm_device/table.py $V/compare --runs run3,run4   # the pairs docs/validation.md judges (the driver with gc.freeze; run1,run2: the earlier pairs)
