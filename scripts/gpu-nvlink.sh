#!/usr/bin/env bash
# NVLink / copy-engine transports on a 2-GPU machine: probe, correctness worker, benchmark.
# Usage: bash scripts/gpu-nvlink.sh [probe] [tests] [bench] [pytest]   (default: probe tests bench)
# Logs and results go under $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
parts=${*:-probe tests bench}
status=0
step() {  # step NAME TIMEOUT COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  local t0=$SECONDS
  if timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1; then echo "--- $name ok ($((SECONDS - t0)) s)";
  else echo "--- $name FAILED rc=$? ($((SECONDS - t0)) s)"; status=1; fi
  grep -E "FAIL|VERDICT|Error|error" "$OUT/$name.log" | head -n 40
  tail -n 15 "$OUT/$name.log"
}
for part in $parts; do
  case $part in
    probe)
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
      python3 -c "from cuda.bindings import driver; print('cuda.bindings ok')" || echo "no cuda.bindings" ;;
    tests) step nvlink-worker 300 python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/nvlink/_worker.py nvlink mismatch ce ;;
    pytest) step nvlink-pytest 300 python3 -m pytest -q -p no:cacheprovider tests/nvlink ;;
    bench) step sendrecv-bench 330 python3 -m tensorferry.cli.main bench sendrecv \
             --out "$OUT/bench" --tune --overlap ${BENCH_ARGS:-} ;;
  esac
done
exit $status
