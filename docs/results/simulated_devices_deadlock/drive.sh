#!/bin/bash
# usage: [P=prefix] [GDB=1] [OUT=dir] drive.sh N test|stress
# Runs the model-parallel test's child ("test": full_softmax plif) or
# stress_child.py ("stress": full_softmax) N times on 4 host CPU devices,
# from any directory (the package's Python environment active), logs in
# OUT (default /tmp/rdv). At XLA's "may be stuck" warning (20 s into a
# rendezvous) the run is counted STUCK and killed; with GDB=1 the process
# is first stopped and every thread's stack written to ${P}gdb<i>.txt.
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
mkdir -p "${OUT:=/tmp/rdv}"
case "$2" in
  test) child=(tests/test_vocabulary_parallel_training.py full_softmax plif) ;;
  stress) child=("$HERE/stress_child.py" full_softmax) ;;
  *) echo "usage: drive.sh N test|stress" >&2; exit 2 ;;
esac
for i in $(seq 1 "$1"); do
  log=$OUT/${P}run$i.err
  start=$(date +%s)
  KERAS_BACKEND=jax PYTHONPATH=$PWD/tests:$PWD \
  XLA_FLAGS="--xla_force_host_platform_device_count=4" \
    python "${child[@]}" > "$OUT/${P}run$i.out" 2> "$log" &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    sleep 1
    if grep -q "may be stuck" "$log"; then
      if [ "${GDB:-0}" = 1 ]; then
        kill -STOP $pid
        timeout 400 gdb -p $pid -batch -ex "thread apply all bt 30" > "$OUT/${P}gdb$i.txt" 2>&1
      fi
      echo "run $i: STUCK"; kill -9 $pid; break
    fi
  done
  wait $pid 2>/dev/null; echo "run $i rc=$? $(( $(date +%s)-start ))s"
done
