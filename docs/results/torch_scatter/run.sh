#!/bin/bash
# Alternates processes of step.py with the package before (OLD, default 5140b47~1) and after
# (this checkout); one thread each, pinned to
# core 0. Usage: bash run.sh ROUNDS OUTDIR   (needs the package's environment active)
set -e
ROUNDS=${1:-3}; OUT=${2:-.}; OLD=${OLD:-5140b47~1}
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(git -C "$HERE" rev-parse --show-toplevel)
WT=$(mktemp -d); git -C "$ROOT" worktree add -q --detach "$WT" "$OLD"
trap 'git -C "$ROOT" worktree remove --force "$WT"' EXIT
for r in $(seq 1 "$ROUNDS"); do
  for side in old new; do
    src=$ROOT; [ $side = old ] && src=$WT
    line=$(cd /tmp && PYTHONPATH=$src OMP_NUM_THREADS=1 taskset -c 0 python "$HERE/step.py" 2>/dev/null | tail -n 1)
    echo "{\"round\": $r, \"side\": \"$side\", \"steps\": $line}" | tee -a "$OUT/ab.jsonl"
  done
done
