#!/bin/bash
# The adaptive row of adaptive_wikitext2 for 150 s, gradient_in_forward on (None: the CPU default)
# and off, side by side, one core each (single-threaded), then with the cores swapped.
# SRC: a checkout (72d8e74 for the files here); OUT: where the rows' work directories and JSON go.
HERE=$(cd $(dirname $0) && pwd)
cd ${SRC:-/work/main} && . /work/venv/bin/activate
export OUT=${OUT:-/work/loopcheck} TF_CPP_MIN_LOG_LEVEL=3 OMP_NUM_THREADS=1 TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=1
mkdir -p $OUT
run() { taskset -c $1 python $HERE/row.py $2 $3 150 > $OUT/$2.log 2>&1; }
run 0 on_a none & run 1 off_a false & wait
run 1 on_b none & run 0 off_b false & wait
echo done > $OUT/done
