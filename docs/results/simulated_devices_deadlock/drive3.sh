#!/bin/bash
# usage: P=prefix drive3.sh N ; runs stress_child.py full_softmax, kills at the stuck warning
# From any directory; OUT (default /tmp/rdv) gets the logs.
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
mkdir -p "${OUT:=/tmp/rdv}"
for i in $(seq 1 $1); do
  log=$OUT/${P}run$i.err
  start=$(date +%s)
  KERAS_BACKEND=jax PYTHONPATH=$PWD/tests:$PWD \
  XLA_FLAGS="--xla_force_host_platform_device_count=4" \
    python "$HERE/stress_child.py" full_softmax > $OUT/${P}run$i.out 2> $log &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    sleep 1
    if grep -q "may be stuck" $log; then echo "run $i: STUCK"; kill -9 $pid; break; fi
  done
  wait $pid; echo "run $i rc=$? $(( $(date +%s)-start ))s"
done
