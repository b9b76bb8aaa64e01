#!/usr/bin/env bash
# Five random-traffic loops (scripts/random_traffic_probe.py) side by side on this host's CPUs
# until LIMIT seconds pass, then a per-loop summary. Runs that end in a timeout keep their output
# and traces in one archive, $OUT/timeouts.tgz (one file: the device machine caps file counts).
# Usage: [TIERS=1] [LIMIT=300] [MODE=mixed|gloo|programs|nccl] bash scripts/random-traffic-sweeps.sh
#   TIERS=1 first runs the one-GPU test tier; MODE=gloo runs plain gloo in five seed ranges,
#   mixed runs gloo-spec lanes (one with broken messages) beside one plain gloo lane, programs
#   runs the probe's --programs case (three and four ranks, gloo and gloo-spec; two lanes
#   without mistakes, three with one message in ten sent with the wrong shape; three calls in
#   ten a batch, but in lane c); nccl runs --programs over NCCL with every rank on GPU 0 (see
#   tests/p2p/_pool.py: TF_TEST_ONE_GPU_RANKS), two lanes of three and four ranks, lone calls,
#   a seed with no answer in 60 s counted as stalled.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD
if [ "${TIERS:-0}" = 1 ]; then
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime tests/p2p tests/graph 2>&1 | tail -3
fi
LIMIT=${LIMIT:-300}
out=/tmp/sweeps; rm -rf "$out"; mkdir -p "$out"
visible=""  # CPU lanes hide the GPUs; MODE=nccl puts every rank on GPU 0
lanes="a b c d e"
lane() {  # lane NAME ARGS...
  local name=$1; shift; local n=0 end=$((SECONDS + LIMIT))
  while [ $SECONDS -lt $end ]; do
    n=$((n + 1))
    CUDA_VISIBLE_DEVICES=$visible timeout $((end - SECONDS + 5)) python3 scripts/random_traffic_probe.py "$@" --trace "$out/trace-$name-$n" > "$out/$name-$n.txt" 2>&1
    echo "rc=$?" >> "$out/$name-$n.txt"
  done
}
if [ "${MODE:-mixed}" = gloo ]; then  # plain gloo only, five seed ranges
  lane a --count 24 --seeds 1000:1100 &
  lane b --count 24 --seeds 1100:1200 &
  lane c --count 24 --seeds 1200:1300 &
  lane d --count 24 --seeds 1300:1400 &
  lane e --count 24 --seeds 1400:1500 &
elif [ "${MODE:-mixed}" = nccl ]; then
  visible=0 lanes="a b"
  export TF_TEST_ONE_GPU_RANKS=1
  nccl=(--programs --backend auto --transport auto --changed 0 --wait 8 --seed-timeout 60)
  lane a "${nccl[@]}" --count 24 --seeds 1000:1100 &
  lane b "${nccl[@]}" --count 32 --world 4 --seeds 2000:2100 &
elif [ "${MODE:-mixed}" = programs ]; then  # each rank in an order of its own, waits between
  lane a --programs --changed 0 --batches 0.3 --count 24 --seeds 1000:1100 &
  lane b --programs --changed 0 --batches 0.3 --transport gloo-spec --count 32 --world 4 \
    --seeds 2000:2100 &
  lane c --programs --changed 0.1 --count 24 --seeds 1000:1100 &
  lane d --programs --changed 0.1 --batches 0.3 --transport gloo-spec --count 24 \
    --seeds 1000:1100 &
  lane e --programs --changed 0.1 --batches 0.3 --count 32 --world 4 --seeds 2000:2100 &
else
  lane a --transport gloo-spec --count 24 --seeds 1100:1200 &
  lane b --transport gloo-spec --count 24 --seeds 1150:1200 &
  lane c --count 24 --seeds 1000:1100 &
  lane d --transport gloo-spec --count 24 --broken 0.1 --changed 0 --seeds 3200:3300 &
  lane e --transport gloo-spec --count 24 --seeds 1170:1200 &
fi
wait
for lane in $lanes; do
  full=0; cut=0; seeds=0; tmo=0; wrong=0; stalled=0; uneven=""
  for f in "$out"/$lane-*.txt; do
    if grep -q "^rc=0" "$f"; then full=$((full + 1)); else cut=$((cut + 1)); fi
    seeds=$((seeds + $(grep -c "^seed" "$f")))
    tmo=$((tmo + $(grep "^seed" "$f" | grep -c "Timeout")))
    wrong=$((wrong + $(grep -c "wrong bytes" "$f")))
    stalled=$((stalled + $(grep -c "^seed .*: stalled" "$f")))
    uneven="$uneven $(grep "^seed" "$f" | grep -vc "every message ended alike")"
  done
  echo "lane $lane: full runs $full, cut $cut, seeds $seeds, seeds with a timeout $tmo, stalled $stalled, wrong bytes $wrong, uneven per run:$uneven"
done | tee "$out/summary.txt"
keep=()
for f in "$out"/*.txt; do
  if grep "^seed" "$f" | grep -q Timeout; then
    run=$(basename "$f" .txt)
    echo "== $run:"; grep "^seed" "$f" | grep Timeout | cut -c1-600
    keep+=("$run.txt" "trace-$run")
  fi
done
[ ${#keep[@]} -gt 0 ] && (cd "$out" && tar czf "${OUT:-/tmp}/timeouts.tgz" "${keep[@]}")
