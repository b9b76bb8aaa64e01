#!/usr/bin/env bash
# Runs on a 2-GPU machine: doctor, the GPU test tiers and the benchmarks, each step bounded.
# Usage: bash scripts/gpu-check.sh STEP...   (default: every step, in this order)
#   runtime native lifecycle p2p p2p-nospeculate p2p-socket toy batch batch-torch batch-nospin batch-noshort ce-overlap ce-probe ce-tests trace
#   trace-nospeculate trace-noshort trace-no-linger nvlink-configs nvlink-ceiling trace-graph
#   trace-overlap graph graph-one-gpu graph-one-gpu-torch-calls graph-bench overlap overlap-early overlap-noearly demo sendrecv p2p-ranks p2p-ranks-nvlink p2p-ranks-ce
#   p2p-one-gpu p2p-torch-calls p2p-one-gpu-torch-calls p2p-ranks-one-gpu p2p-ranks-one-gpu-nospeculate p2p-ranks-nospeculate allgather symm-pairs stream-probe profile-pingpong profile-graph send-floor send-overhead
# profile-* sample every thread's Python stack with py-spy (from a wheel put in .whl/, no network
# needed) and keep the collapsed stacks in the results: where host time goes.
# p2p-nospeculate runs the p2p GPU tier with the NCCL transport's speculative issue turned off;
# batch-noshort and trace-noshort run those without the engine's short way (A/Bs of it).
# send-floor and send-overhead print the host time of one send from the bare NCCL call up
# (scripts/send_floor_probe.py) and the layer's host time per call over NCCL, 1 and 64 tensors
# (scripts/send_overhead_probe.py --nccl; also its --ab-lone-call, --ab-gil, --ab-link-calls,
# --ab-event-calls and, for 64 tensors, --phases; and scripts/event_calls_probe.py);
# send-overhead also runs that probe and batch_overhead_probe.py with no wire, and
# side_channel_probe.py (this host's Python and sockets).
# p2p-one-gpu and p2p-ranks-one-gpu (ONE_GPU_RANKS ranks, default 3) run the NCCL tier and the
# N-rank suite with every rank on one GPU, each posing as its own host to NCCL (NCCL_HOSTID):
# NCCL's network transport between them, so correctness only, on a machine with one GPU.
# graph-one-gpu runs the graph layer's GPU tier the same way: its NCCL edges between two actors on
# one GPU, each posing as a host of its own (tests/graph/one_gpu.py).
# *-torch-calls: the p2p tier with ProcessGroupNCCL pairs (TENSORFERRY_NCCL_CALLS=torch), the
# NCCL transport's fallback where the NCCL library cannot be called directly; for the graph
# tier, its NCCL edges over one ProcessGroupNCCL per graph (graph-one-gpu-torch-calls).
# *-nospeculate: the same with TENSORFERRY_NCCL_SPECULATE=0 (with three ranks or more that is
# the default, and the suite runs its two cases of messages issued ahead to several peers: see
# torchrun_suite.py).
# p2p-ranks*, allgather and symm-pairs use every GPU of the machine (one rank each): the N-rank runs;
# p2p-ranks-nvlink/-ce run the same suite with `auto` picking that transport for GPU tensors.
# Logs and results are packed into $OUT/gpu-logs.tgz (or ./out; a second run in the same folder
# writes gpu-logs-2.tgz, and so on, rather than replace the first); a summary prints last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL=${OUT:-$PWD/out}
LOGS=/tmp/tensorferry-gpu
rm -rf "$LOGS" && mkdir -p "$LOGS/results" "$FINAL"
# The package runs from the source tree; give it its console script and a `python`.
mkdir -p /tmp/tf-bin
printf '#!/bin/sh\nexec python3 -m tensorferry.cli.main "$@"\n' >/tmp/tf-bin/tensorferry
command -v python >/dev/null || ln -sf "$(command -v python3)" /tmp/tf-bin/python
chmod +x /tmp/tf-bin/tensorferry && export PATH=/tmp/tf-bin:$PATH
SOCKET=(env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")  # ranks of the N-rank steps
R=$LOGS/results
summary=()
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1; rc=$?
  summary+=("$(printf '%-14s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
  echo "=== $name rc=$rc ($((SECONDS - t0)) s)"
  grep -E "passed|failed|FAILED|Error|VERDICT|speed|x cheaper|ratio" "$LOGS/$name.log" | tail -n 12
}
steps=${*:-runtime native lifecycle p2p p2p-socket toy batch graph graph-bench overlap demo sendrecv}
python3 -m tensorferry.cli.main doctor >"$LOGS/doctor.log" 2>&1
head -n 20 "$LOGS/doctor.log"
for s in $steps; do
  case $s in
    runtime) step runtime 60 python3 -m pytest -q -p no:cacheprovider tests/runtime ;;
    native) step native 120 python3 -m pytest -q -p no:cacheprovider tests/test_native.py ;;
    lifecycle) step lifecycle 40 tensorferry bench lifecycle --cycles 1000 --out "$R" ;;
    p2p) step p2p 100 env TF_TEST_DUMP_AFTER=60 python3 -m pytest -q --tb=short -p no:cacheprovider \
      tests/p2p/test_p2p_gpu.py ;;
    p2p-nospeculate) step p2p-nospeculate 75 env TENSORFERRY_NCCL_SPECULATE=0 TF_TEST_DUMP_AFTER=40 \
      python3 -m pytest -x -q --tb=short -p no:cacheprovider tests/p2p/test_p2p_gpu.py ;;
    p2p-socket) step p2p-socket 90 "${SOCKET[@]}" env TF_TEST_DUMP_AFTER=40 python3 -m pytest -x -q \
      --tb=short -p no:cacheprovider \
      tests/p2p/test_p2p_gpu.py ;;
    toy) step toy 170 tensorferry bench toy --device cuda --out "$R" ;;
    batch) step batch 45 tensorferry bench batch --device cuda --out "$R" ;;
    batch-torch) step batch-torch 45 env TENSORFERRY_NCCL_CALLS=torch tensorferry bench batch \
      --device cuda --large-mib 0 ;;
    batch-nospin) step batch-nospin 45 env TENSORFERRY_SPIN_US=0 tensorferry bench batch \
      --device cuda ;;
    batch-noshort) step batch-noshort 45 env TENSORFERRY_P2P_SHORT_PATH=0 tensorferry bench batch \
      --device cuda --out "$R/noshort" ;;
    graph) step graph 240 python3 -m pytest -q -p no:cacheprovider -rs tests/graph/test_gpu.py ;;
    graph-one-gpu) step graph-one-gpu 240 env TF_TEST_ONE_GPU_ACTORS=1 python3 -m pytest -q \
      -p no:cacheprovider -rs tests/graph/test_gpu.py ;;
    graph-one-gpu-torch-calls) step "$s" 240 env TF_TEST_ONE_GPU_ACTORS=1 TENSORFERRY_NCCL_CALLS=torch \
      python3 -m pytest -q -p no:cacheprovider -rs tests/graph/test_gpu.py ;;
    graph-bench) step graph-bench 50 tensorferry bench graph --out "$R" ;;
    overlap) step overlap 240 tensorferry bench overlap --iters 20 --transports auto,ce --out "$R" ;;
    overlap-early | overlap-noearly)  # NCCL edges with and without early receives (an A/B)
      early=1 && [ "$s" = overlap-noearly ] && early=0
      step "$s" 150 env TENSORFERRY_GRAPH_EARLY_RECEIVES=$early tensorferry bench overlap \
        --iters 20 --transports auto --out "$R/$s" ;;
    demo) step demo 45 tensorferry demo --out "$LOGS/demo" ;;
    sendrecv) step sendrecv 70 tensorferry bench sendrecv --sizes "${SENDRECV_SIZES:-1M,64M,1G}" \
      --transports "${SENDRECV_TRANSPORTS:-nccl,nvlink,ce}" --max-seconds-per-point 0.3 \
      --out "$R/sendrecv" ;;
    ce-overlap) step ce-overlap 120 tensorferry bench sendrecv --sizes 1G --transports nccl,ce \
      --modes one_way --overlap --max-seconds-per-point 0.3 --out "$R/overlap-ce" ;;
    trace) step trace 60 python3 scripts/trace_pingpong.py ;;
    trace-no-linger) step trace-no-linger 60 python3 scripts/trace_pingpong.py --no-linger ;;
    nvlink-configs) step nvlink-configs 200 python3 -m torch.distributed.run --standalone \
      --nproc-per-node 2 scripts/nvlink_config_probe.py ;;
    nvlink-ceiling) step nvlink-ceiling 240 python3 -m torch.distributed.run --standalone \
      --nproc-per-node 2 scripts/nvlink_ceiling_probe.py ;;
    trace-nospeculate) step trace-nospeculate 75 python3 scripts/trace_pingpong.py --no-speculate \
      --dump-after 45 ;;
    trace-noshort) step trace-noshort 75 python3 scripts/trace_pingpong.py --no-short \
      --dump-after 45 ;;
    stream-probe) step stream-probe 90 python3 scripts/stream_create_probe.py ;;
    ce-probe) step ce-probe 60 python3 scripts/ce_overlap_probe.py ;;
    ce-tests) step ce-tests 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
      tests/nvlink/_worker.py ce ;;
    p2p-one-gpu) step p2p-one-gpu 150 env TF_TEST_ONE_GPU_RANKS=1 TF_TEST_DUMP_AFTER=60 python3 -m \
      pytest -q --tb=short -p no:cacheprovider -rs tests/p2p/test_p2p_gpu.py ;;
    p2p-torch-calls) step "$s" 150 env TENSORFERRY_NCCL_CALLS=torch TF_TEST_DUMP_AFTER=90 python3 -m \
      pytest -q --tb=short -p no:cacheprovider -rs tests/p2p/test_p2p_gpu.py ;;
    p2p-one-gpu-torch-calls) step "$s" 150 env TENSORFERRY_NCCL_CALLS=torch TF_TEST_ONE_GPU_RANKS=1 \
      TF_TEST_DUMP_AFTER=90 python3 -m pytest -q --tb=short -p no:cacheprovider -rs \
      tests/p2p/test_p2p_gpu.py ;;
    p2p-ranks-one-gpu) step p2p-ranks-one-gpu 240 env TF_TEST_DUMP_AFTER=200 python3 -m \
      torch.distributed.run --standalone --nproc-per-node "${ONE_GPU_RANKS:-3}" \
      scripts/one_gpu_ranks.py tests/p2p/torchrun_suite.py ;;
    p2p-ranks-one-gpu-nospeculate) step "$s" 240 env TENSORFERRY_NCCL_SPECULATE=0 \
      TF_TEST_DUMP_AFTER=200 python3 -m torch.distributed.run --standalone \
      --nproc-per-node "${ONE_GPU_RANKS:-3}" scripts/one_gpu_ranks.py tests/p2p/torchrun_suite.py ;;
    p2p-ranks-nospeculate) step "$s" 240 env TENSORFERRY_NCCL_SPECULATE=0 python3 -m \
      torch.distributed.run --standalone --nproc-per-node "$GPUS" tests/p2p/torchrun_suite.py ;;
    p2p-ranks) step p2p-ranks 240 python3 -m torch.distributed.run --standalone \
      --nproc-per-node "$GPUS" tests/p2p/torchrun_suite.py ;;
    allgather) step allgather 150 tensorferry bench allgather \
      --transports "${ALLGATHER_TRANSPORTS:-nccl}" --out "$R" ;;
    p2p-ranks-nvlink | p2p-ranks-ce) step "$s" "${RANKS_LIMIT:-150}" env TENSORFERRY_AUTO_TRANSPORTS="${s#p2p-ranks-},gloo" \
      TF_TEST_DUMP_AFTER=$((${RANKS_LIMIT:-150} - 25)) python3 -m torch.distributed.run --standalone --nproc-per-node "$GPUS" \
      tests/p2p/torchrun_suite.py ;;
    symm-pairs) step symm-pairs 60 env PROBE_LIMIT=45 python3 -m torch.distributed.run --standalone \
      --nproc-per-node "$GPUS" scripts/symm_pairs_probe.py ;;
    trace-graph) step trace-graph 60 python3 scripts/trace_graph.py ;;
    send-floor) step send-floor 150 python3 scripts/send_floor_probe.py
      tail -n 12 "$LOGS/send-floor.log" ;;
    send-overhead) step send-overhead 150 python3 scripts/send_overhead_probe.py --nccl
      step send-overhead-64 150 python3 scripts/send_overhead_probe.py --nccl --tensors 64
      # A lone tensor's issue in one compiled call against the Python one, in one process.
      step send-overhead-one-call 150 python3 scripts/send_overhead_probe.py --nccl --ab-lone-call
      # NCCL's launching calls keeping the GIL against letting go of it, in one process.
      step send-overhead-gil 150 python3 scripts/send_overhead_probe.py --nccl --ab-gil
      # The side channel's calls through the compiled helper against the socket's methods.
      step send-overhead-links 150 python3 scripts/send_overhead_probe.py --nccl --ab-link-calls
      # The CUDA event calls through the compiled helper against ctypes, and each call's cost.
      step send-overhead-events 150 python3 scripts/send_overhead_probe.py --nccl --ab-event-calls
      step event-calls 90 python3 scripts/event_calls_probe.py
      step send-overhead-phases-64 150 python3 scripts/send_overhead_probe.py --nccl --tensors 64 \
        --phases
      # The same with no wire (both ranks on cuda:0): what this host's Python costs, to hold
      # against the one-GPU machine's numbers and the NCCL rows above.
      step send-overhead-null 150 python3 scripts/send_overhead_probe.py
      step batch-overhead-null 150 python3 scripts/batch_overhead_probe.py
      step side-channel 60 python3 scripts/side_channel_probe.py
      tail -n 20 "$LOGS"/send-overhead*.log "$LOGS/batch-overhead-null.log" "$LOGS/side-channel.log" \
        "$LOGS/event-calls.log" ;;
    profile-pingpong | profile-graph)
      if ! ls .whl/py_spy-*.whl >/dev/null 2>&1; then
        echo "=== $s: no .whl/py_spy-*.whl here (git-ignored: carry .whl to the GPU machine)"
        summary+=("$(printf '%-14s rc=%-3s %4ss' "$s" "skip" 0)")
        continue
      fi
      pip install -q --no-deps --no-index .whl/py_spy-*.whl >/dev/null 2>&1
      target=(scripts/trace_pingpong.py)
      [ "$s" = profile-graph ] && target=(scripts/trace_graph.py --graph echo --iters 3000)
      step "$s" 120 py-spy record --subprocesses --threads --idle --nonblocking --format raw --rate 1000 \
        -o "$R/$s.txt" -- python3 "${target[@]}" ;;
    trace-overlap) step trace-overlap 120 python3 scripts/trace_graph.py --graph overlap --png "$R" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
for line in "${summary[@]}"; do echo "$line"; done
for f in "$R"/*.md "$R"/*/*.md; do [ -f "$f" ] && { echo "--- $f"; sed -n '/^|/p' "$f"; }; done
pack="$FINAL/gpu-logs.tgz"
n=1
while [ -e "$pack" ]; do n=$((n + 1)); pack="$FINAL/gpu-logs-$n.tgz"; done
tar -czf "$pack" -C /tmp tensorferry-gpu
