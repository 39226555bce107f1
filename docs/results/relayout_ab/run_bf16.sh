#!/bin/bash
cd /work/main
. /work/venv/bin/activate
export OMP_NUM_THREADS=2 TF_CPP_MIN_LOG_LEVEL=3
OUT=/work/ab/out
while [ ! -f $OUT/done ]; do sleep 5; done
LCE="--tokens=2048 --dim=1024 --vocab_sizes=65536 --rows=ours --threads=2 --repeats=3"
for round in 1 2; do
for lib in base main wt-bf16; do
  PYTHONPATH=/work/$lib python benchmarks/bench_linear_cross_entropy.py --backend=tensorflow --mode=graph --dtypes=bfloat16 $LCE \
    --out=$OUT/bf16_${lib}_$round.json > $OUT/bf16_${lib}_$round.log 2>&1
done
done
echo ALLDONE > $OUT/done_bf16
