#!/usr/bin/env bash
# A/B on one GPU machine: gpu-check steps from an older tree and from this one, alternately, so
# that both see the same period of the machine (its host times drift 2x between periods).
# Usage:
#   on the development machine:  mkdir ab_base && git archive REV | tar -x -C ab_base
#                                (leave ab_base/ untracked: it travels with the working tree)
#   on the GPU machine:          bash scripts/gpu-ab.sh ab_base ROUNDS STEP...
# Each round runs every step from ab_base/ ("base"), then from this tree ("new"). The tables
# and verdicts go to $OUT/ab.txt (or ./out/ab.txt).
set -u
cd "$(dirname "$0")/.."
base=${1:?usage: gpu-ab.sh BASE_DIR ROUNDS STEP...} rounds=${2:?rounds} && shift 2
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
log="$OUT/ab.txt"
for round in $(seq "$rounds"); do
  for tree in base new; do
    root=.
    [ "$tree" = base ] && root=$base
    echo "##### round $round, $tree: $* ($(date +%T))" >>"$log"
    (OUT=/tmp/ab-$tree timeout -k 5 "${AB_LIMIT_S:-150}" bash "$root/scripts/gpu-check.sh" "$@") 2>&1 |
      grep -E "^===|^\||passed|failed|iteration" >>"$log"
  done
done
cat "$log"
