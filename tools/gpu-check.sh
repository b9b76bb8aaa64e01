#!/usr/bin/env bash
# The GPU test tiers and the benchmarks, on a machine with two or more GPUs; each step bounded.
#
# Usage: bash tools/gpu-check.sh [STEP...]      (no STEP: the default list below, in order)
#   tests:       gpu multigpu p2p-ranks graph
#   benchmarks:  peers sendrecv batch toy overlap graph-bench
#   on request:  one-gpu lifecycle allgather
#
# gpu, multigpu   python -m pytest -m gpu / -m multigpu (the graph tier runs in its own step)
# p2p-ranks       the p2p torchrun suite, one rank per GPU of the machine
# graph           the graph layer's GPU tier (tests/graph/test_gpu.py)
# one-gpu         the NCCL tiers with every rank (and actor) on one GPU, each posing to NCCL as a
#                 host of its own: correctness over NCCL's network transport on a one-GPU machine
# peers ... graph-bench, lifecycle, allgather
#                 `tensorferry bench NAME`, each with its baseline in the same run; tables and
#                 CSV go to $OUT/results, to be copied onto the pages under benchmarks/
#
# Logs go to $OUT (default ./out): one log per step, then a summary line per step.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-$PWD/out}
LOGS=$OUT/logs
RESULTS=$OUT/results
mkdir -p "$LOGS" "$RESULTS"
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
TF=(python3 -m tensorferry.cli.main)
TORCHRUN=(python3 -m torch.distributed.run --standalone)
summary=()

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc
  timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  summary+=("$(printf '%-12s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
  echo "=== $name rc=$rc ($((SECONDS - t0)) s)"
  tail -n 8 "$LOGS/$name.log"
}

bench() {  # bench STEP NAME LIMIT_S ARGS...: `tensorferry bench NAME`, skipped if this tree lacks it
  local name=$1 benchmark=$2 limit=$3
  shift 3
  if ! "${TF[@]}" bench "$benchmark" --help >/dev/null 2>&1; then
    echo "=== $name: no 'tensorferry bench $benchmark' in this tree, skipped"
    summary+=("$(printf '%-12s rc=%-3s %4ss' "$name" skip 0)")
    return
  fi
  step "$name" "$limit" "${TF[@]}" bench "$benchmark" "$@" --out "$RESULTS"
}

if [ "$GPUS" -lt 2 ]; then
  echo "this machine has $GPUS GPU(s): the multi-GPU steps skip; 'one-gpu' runs the NCCL tiers"
fi
"${TF[@]}" doctor >"$LOGS/doctor.log" 2>&1
head -n 20 "$LOGS/doctor.log"
pytest=(python3 -m pytest -q -rs -p no:cacheprovider)

for s in ${*:-gpu multigpu p2p-ranks graph peers sendrecv batch toy overlap graph-bench}; do
  case $s in
    gpu) step gpu 300 "${pytest[@]}" -m gpu --ignore=tests/graph/test_gpu.py ;;
    multigpu) step multigpu 400 "${pytest[@]}" -m multigpu --ignore=tests/graph/test_gpu.py ;;
    p2p-ranks) step p2p-ranks 240 "${TORCHRUN[@]}" --nproc-per-node "$GPUS" \
      tests/p2p/torchrun_suite.py ;;
    graph) step graph 300 "${pytest[@]}" tests/graph/test_gpu.py ;;
    one-gpu)
      step one-gpu-p2p 200 env TF_TEST_ONE_GPU_RANKS=1 "${pytest[@]}" tests/p2p/test_p2p_gpu.py
      step one-gpu-ranks 240 "${TORCHRUN[@]}" --nproc-per-node 3 tools/one_gpu_ranks.py \
        tests/p2p/torchrun_suite.py
      step one-gpu-graph 300 env TF_TEST_ONE_GPU_ACTORS=1 "${pytest[@]}" tests/graph/test_gpu.py ;;
    peers) bench peers peers 300 ;;
    sendrecv) bench sendrecv sendrecv 120 --sizes 4K,64K,8M,64M,256M,1G --max-seconds-per-point 0.3 ;;
    batch) bench batch batch 90 --device cuda ;;
    toy) bench toy toy 200 --device cuda ;;
    overlap) bench overlap overlap 300 --iters 20 --transports auto,ce ;;
    graph-bench) bench graph-bench graph 90 ;;
    lifecycle) bench lifecycle lifecycle 60 --cycles 1000 ;;
    allgather) bench allgather allgather 200 ;;
    *)
      echo "unknown step $s (see the top of $0)"
      exit 2
      ;;
  esac
done
echo "--- summary (logs in $LOGS, results in $RESULTS)"
for line in "${summary[@]}"; do echo "$line"; done
