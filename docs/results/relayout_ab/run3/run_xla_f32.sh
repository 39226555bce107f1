#!/bin/bash
# Three more rounds (3-5) of run.sh's TensorFlow XLA float32 row, base and main interleaved.
cd /work/snap3
. /work/venv/bin/activate
export OMP_NUM_THREADS=2 TF_CPP_MIN_LOG_LEVEL=3
OUT=${OUT:-/work/ab3/out}; mkdir -p $OUT
LCE="--tokens=2048 --dim=1024 --vocab_sizes=65536 --rows=ours --threads=2 --repeats=3"
for round in 3 4 5; do
  for lib in base main; do
    PYTHONPATH=/work/$([ $lib = main ] && echo snap3 || echo base) python benchmarks/bench_linear_cross_entropy.py --backend=tensorflow --mode=xla --dtypes=float32 $LCE \
      --out=$OUT/lce_tensorflow_xla_float32_${lib}_$round.json > $OUT/lce_tensorflow_xla_float32_${lib}_$round.log 2>&1
  done
done
echo ALLDONE > $OUT/done_xla_f32
