#!/bin/bash
# usage: P=prefix drive2.sh N
# From any directory; OUT (default /tmp/rdv) gets the logs.
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
mkdir -p "${OUT:=/tmp/rdv}"
for i in $(seq 1 $1); do
  log=$OUT/${P}run$i.err
  start=$(date +%s)
  KERAS_BACKEND=jax PYTHONPATH=$PWD/tests:$PWD \
  XLA_FLAGS="--xla_force_host_platform_device_count=4" \
    python tests/test_vocabulary_parallel_training.py full_softmax plif > $OUT/${P}run$i.out 2> $log &
  pid=$!
  dumped=0
  while kill -0 $pid 2>/dev/null; do
    sleep 1
    if [ $dumped = 0 ] && grep -q "may be stuck" $log; then
      kill -STOP $pid; timeout 400 gdb -p $pid -batch -ex "thread apply all bt 30" > $OUT/${P}gdb$i.txt 2>&1
      dumped=1; kill -CONT $pid
      echo "run $i: STUCK, dumped"; kill $pid
    fi
  done
  wait $pid; echo "run $i rc=$? $(( $(date +%s)-start ))s"
done
