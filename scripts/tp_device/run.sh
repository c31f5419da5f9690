#!/usr/bin/env bash
# Issue 32's runs, one command each, from the repository root on the device machine:
#   bash scripts/tp_device/run.sh dry-run-tp1       # nvidia-h200: the TP code path on 1 GPU
#   bash scripts/tp_device/run.sh profile-8b-tp2    # nvidia-h200-x2
#   bash scripts/tp_device/run.sh profile-70b-tp2   # nvidia-h200-x2
#   bash scripts/tp_device/run.sh profile-70b-tp4   # nvidia-h200-x4
#   bash scripts/tp_device/run.sh validate-70b-tp2 RUN   # nvidia-h200-x2, RUN = run1, run2;
#                                                   # carry .valdata (simkv validate prepare)
# Each writes $OUT/<what>.tar.gz (the folder it measured; the device returns at most 8 files,
# two folders down) and a log, $OUT/<what>.log. NVLink multicast stays off in every process (the device README).
# scripts/tp_device/README.md says where each result goes in the repository.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/tp-device}
what=${1:?usage: run.sh dry-run-tp1 | profile-8b-tp2 | profile-70b-tp2 | profile-70b-tp4 | validate-70b-tp2 RUN}
mkdir -p "$OUT/$what"

header() {
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m | head -6
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
}

profile() {   # MODEL TP BUDGET_S: the profile, then its fit beside it
  python3 -m simkv.gpu.profiler --model "$1" --tensor-parallel-size "$2" \
    --block-sizes 16,32,64,8,128 --time-budget-s "$3" --out "$OUT/$what"
  echo "profile rc $?"
  python3 -m simkv.cli fit "$OUT/$what"; echo "fit rc $?"
}

{
  header
  case "$what" in
    dry-run-tp1)
      # the TP engine, profiler and collectives over NCCL with one rank: everything but the
      # second GPU (a tiny model through the engine, then a quick 8B profile)
      python3 scripts/tp_device/dry_run.py --out "$OUT/$what"; echo "dry run rc $?" ;;
    profile-8b-tp2) profile llama-3.1-8b 2 500 ;;
    profile-70b-tp2) profile llama-3.1-70b 2 520 ;;
    profile-70b-tp4) profile llama-3.1-70b 4 520 ;;
    validate-70b-tp2)
      run=${2:?validate-70b-tp2 needs RUN (run1 or run2)}
      python3 -m simkv.cli validate measure scenarios/validation/azure-conv-70b-tp2-bs16.yaml \
        --data .valdata --out "$OUT/$what" --no-trace
      echo "measure rc $?"
      mv "$OUT/$what/azure-conv-70b-tp2-bs16" "$OUT/$what/$run" ;;
    *) echo "unknown run $what"; exit 2 ;;
  esac
} 2>&1 | tee "$OUT/$what.log"
tar -C "$OUT" -czf "$OUT/$what.tar.gz" "$what" && rm -rf "${OUT:?}/$what"
