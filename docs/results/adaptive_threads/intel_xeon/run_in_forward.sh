#!/bin/bash
# The static path, the static path with gradient_in_forward=True and torch's module, at 1 and 2
# threads, three rounds, fresh processes (bench_adaptive.py). SRC: a checkout at the commit measured.
SRC=${SRC:-/work/main}
cd $SRC
. /work/venv/bin/activate
export TF_CPP_MIN_LOG_LEVEL=3
OUT=${OUT:?set OUT}; mkdir -p $OUT
for round in 1 2 3; do
for threads in 2 1; do
  export OMP_NUM_THREADS=$threads TF_NUM_INTRAOP_THREADS=$threads TF_NUM_INTEROP_THREADS=1
  PIN=$([ $threads = 1 ] && echo "taskset -c 0" || echo "")
  $PIN python benchmarks/bench_adaptive.py --threads=$threads --vocab_sizes=33278,100000 \
    --rows=static,in_forward,torch --phases=train --out=$OUT/in_forward_t${threads}_$round.json > $OUT/in_forward_t${threads}_$round.log 2>&1
done
done
echo ALLDONE > $OUT/done
