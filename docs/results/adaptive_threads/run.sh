#!/bin/bash
# AdaptiveSoftmax (static shapes, XLA) train step before (229d9e8, /work/snap3) and after the saved
# first rung (main), and torch's AdaptiveLogSoftmaxWithLoss, at 1 and 2 threads; rows interleaved,
# one fresh process per row (bench_adaptive.py), three rounds.
cd /work/main
. /work/venv/bin/activate
export TF_CPP_MIN_LOG_LEVEL=3
OUT=${OUT:-/work/adaptive_threads}; mkdir -p $OUT
for round in 1 2 3; do
for threads in 2 1; do
  export OMP_NUM_THREADS=$threads TF_NUM_INTRAOP_THREADS=$threads TF_NUM_INTEROP_THREADS=1
  PIN=$([ $threads = 1 ] && echo "taskset -c 0" || echo "")
  $PIN env PYTHONPATH=/work/snap3 python benchmarks/bench_adaptive.py --threads=$threads --vocab_sizes=33278,100000 \
    --rows=static --phases=train --out=$OUT/before_t${threads}_$round.json > $OUT/before_t${threads}_$round.log 2>&1
  $PIN python benchmarks/bench_adaptive.py --threads=$threads --vocab_sizes=33278,100000 \
    --rows=static,dynamic,torch --phases=train --out=$OUT/after_t${threads}_$round.json > $OUT/after_t${threads}_$round.log 2>&1
done
done
echo ALLDONE > $OUT/done
