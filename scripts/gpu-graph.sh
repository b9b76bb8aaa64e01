#!/usr/bin/env bash
# GPU tier of the graph layer, for a 2-GPU machine: GPU tests, the demo and both benchmarks.
# Logs and results go under $OUT (or ./gpu-graph-out). Every step has its own time limit so the
# whole script stays under 5 minutes; a failing step is reported and the others still run.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-graph-out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
status=0

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)" | tee -a "$OUT/summary.log"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "    rc=$rc in $((SECONDS - start))s" | tee -a "$OUT/summary.log"
  tail -n 25 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
}

{ nvidia-smi -L; python -c "import torch; print(torch.__version__, torch.version.cuda)"; } \
  >"$OUT/env.log" 2>&1
step gpu-tests 120 python -m pytest -q -m "gpu or multigpu" tests/graph/test_gpu.py -rs
step demo 45 python -c "from tensorferry.graph.demo import run_graph_demo; \
print(run_graph_demo('$OUT/demo'))"
step bench-graph 50 tensorferry bench graph --iters 2000 --warmup 200 --out "$OUT/bench"
step bench-overlap 70 tensorferry bench overlap --iters 30 --out "$OUT/bench"
echo "=== done, status $status; logs in $OUT" | tee -a "$OUT/summary.log"
exit $status
