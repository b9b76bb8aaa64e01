#!/usr/bin/env bash
# A/B of one probe command between an older tree and this one, on one machine: the trees take
# turns, the first of each round alternating (base first in odd rounds), so both see the same
# periods of a host whose times drift between periods.
# Usage:
#   on the development machine:  mkdir -p ab/base && git archive REV | tar -x -C ab/base
#                                (leave ab/ untracked: it travels with the working tree; copy
#                                the probe into ab/base/scripts/ when the old tree lacks it)
#   where it runs:               bash scripts/probe-ab.sh ab/base ROUNDS COMMAND...
#   e.g.                         bash scripts/probe-ab.sh ab/base 8 python3 scripts/send_overhead_probe.py
# Each run prints "== round R TREE HH:MM:SS" and the command's output; PYTHONPATH points at the
# tree, which is also the working directory.
set -u
cd "$(dirname "$0")/.."
base=${1:?usage: probe-ab.sh BASE_DIR ROUNDS COMMAND...} rounds=${2:?rounds} && shift 2
root=$PWD
base=$(cd "$base" && pwd)
for round in $(seq "$rounds"); do
  order="base new"
  [ $((round % 2)) = 0 ] && order="new base"
  for tree in $order; do
    dir=$root
    [ "$tree" = base ] && dir=$base
    echo "== round $round $tree $(date -u +%T)"
    (cd "$dir" && PYTHONPATH=$dir timeout -k 5 "${AB_LIMIT_S:-120}" "$@")
  done
done
