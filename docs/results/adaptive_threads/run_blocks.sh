#!/bin/bash
# The static path after the tails became blocks of their capacity (bf5aff5), beside torch's
# AdaptiveLogSoftmaxWithLoss and the dynamic path, at 1 and 2 threads; one fresh process per
# row (bench_adaptive.py), three rounds. SRC: a checkout of the package at that commit.
SRC=${SRC:-/work/main}
cd $SRC
. /work/venv/bin/activate
export TF_CPP_MIN_LOG_LEVEL=3
OUT=${OUT:-/work/adaptive_threads}; mkdir -p $OUT
for round in 1 2 3; do
for threads in 2 1; do
  export OMP_NUM_THREADS=$threads TF_NUM_INTRAOP_THREADS=$threads TF_NUM_INTEROP_THREADS=1
  PIN=$([ $threads = 1 ] && echo "taskset -c 0" || echo "")
  $PIN python benchmarks/bench_adaptive.py --threads=$threads --vocab_sizes=33278,100000 \
    --rows=static,dynamic,torch --phases=train --out=$OUT/blocks_t${threads}_$round.json > $OUT/blocks_t${threads}_$round.log 2>&1
done
done
echo ALLDONE > $OUT/done
