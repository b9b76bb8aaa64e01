#!/usr/bin/env bash
# Runs on a GPU machine: doctor, the GPU test tiers and the benchmarks, in one go.
# Usage: bash scripts/gpu-check.sh [runtime] [p2p] [graph] [nvlink] [demo]   (default: all)
# Logs and results go under $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
parts=${*:-runtime p2p graph nvlink demo}
tf() { python3 -m tensorferry.cli.main "$@"; }
status=0
step() {  # step NAME COMMAND...: runs, logs, remembers failure
  local name=$1; shift
  echo "=== $name"
  local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then echo "--- $name ok ($((SECONDS - t0)) s)";
  else echo "--- $name FAILED ($((SECONDS - t0)) s)"; status=1; fi
  tail -n 25 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
tf doctor
for part in $parts; do
  case $part in
    runtime)
      step runtime-tests python3 -m pytest -q -p no:cacheprovider tests/runtime
      step lifecycle-bench tf bench lifecycle --cycles 1000 --out "$OUT/results" ;;
    p2p) [ -f scripts/gpu-p2p.sh ] && step p2p bash scripts/gpu-p2p.sh ;;
    graph) [ -f scripts/gpu-graph.sh ] && step graph bash scripts/gpu-graph.sh ;;
    nvlink) [ -f scripts/gpu-nvlink.sh ] && step nvlink bash scripts/gpu-nvlink.sh ;;
    demo) step demo tf demo ;;
  esac
done
exit $status
