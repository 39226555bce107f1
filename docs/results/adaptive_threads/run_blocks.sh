#!/bin/bash
# The static path after the tails became blocks of their capacity (bf5aff5), beside torch's
# AdaptiveLogSoftmaxWithLoss and the dynamic path, at 1 and 2 threads; one fresh process per
# row (bench_adaptive.py), three rounds. SRC: a checkout of the package at that commit.
# ROWS / NAME (defaults: the run above) choose other rows and the files' prefix, e.g.
# ROWS=static,in_forward,torch NAME=in_forward (intel_xeon/in_forward_t*.json, at bf790bf).
SRC=${SRC:-/work/main}
ROWS=${ROWS:-static,dynamic,torch}
NAME=${NAME:-blocks}
cd $SRC
. /work/venv/bin/activate
export TF_CPP_MIN_LOG_LEVEL=3
OUT=${OUT:-/work/adaptive_threads}; mkdir -p $OUT
for round in 1 2 3; do
for threads in 2 1; do
  export OMP_NUM_THREADS=$threads TF_NUM_INTRAOP_THREADS=$threads TF_NUM_INTEROP_THREADS=1
  PIN=$([ $threads = 1 ] && echo "taskset -c 0" || echo "")
  $PIN python benchmarks/bench_adaptive.py --threads=$threads --vocab_sizes=33278,100000 \
    --rows=$ROWS --phases=train --out=$OUT/${NAME}_t${threads}_$round.json > $OUT/${NAME}_t${threads}_$round.log 2>&1
done
done
echo ALLDONE > $OUT/done
