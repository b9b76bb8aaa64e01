#!/usr/bin/env bash
# GPU tier of tensorferry.p2p on a 2-GPU machine: tests over NCCL (default transports, then
# NCCL's socket transport), a torchrun check, then the toy and batch benchmarks.
# Logs and results go under $OUT (default /tmp/gpu-p2p). Bounded: each step has a timeout and
# the whole script stays under 6 minutes. Copy $RESULTS/*.md into benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-p2p}"
RESULTS="${RESULTS_DIR:-$OUT/results}"
mkdir -p "$OUT" "$RESULTS"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
status=0
step() {  # step NAME TIMEOUT_S COMMAND...
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)" | tee -a "$OUT/summary.txt"
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc  $((SECONDS - t0))s  log: $OUT/$name.log" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python -c \
  "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', \
  torch.cuda.nccl.version())"; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

SOCKET=(env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
# Limits add up to 335 s (< 6 min); expected total is about half of that.
step pytest-nccl 75 python -m pytest tests/p2p/test_p2p_gpu.py -v -s -p no:cacheprovider
step pytest-nccl-socket 75 "${SOCKET[@]}" python -m pytest tests/p2p/test_p2p_gpu.py -v -s \
  -p no:cacheprovider
step torchrun-check 40 python -m torch.distributed.run --standalone --nproc-per-node 2 \
  tests/p2p/torchrun_check.py
step bench-toy 70 tensorferry bench toy --device cuda --out "$RESULTS"
step bench-batch 40 tensorferry bench batch --device cuda --out "$RESULTS"
step bench-toy-socket 35 "${SOCKET[@]}" tensorferry bench toy --device cuda \
  --programs basic_overlap --out "$RESULTS/socket"
echo "status=$status" | tee -a "$OUT/summary.txt"
exit $status
