#!/bin/bash
# A/B: the library at b3ae0db (/work/base) vs the re-laid-out main (/work/main),
# the same (main's) benchmark scripts, base and main interleaved per configuration,
# one row per fresh process, two threads.
cd /work/main
. /work/venv/bin/activate
export OMP_NUM_THREADS=2 TF_CPP_MIN_LOG_LEVEL=3
OUT=/work/ab/out; mkdir -p $OUT
LCE="--tokens=2048 --dim=1024 --vocab_sizes=65536 --rows=ours --threads=2 --repeats=3"
for round in 1 2; do
for cfg in "tensorflow graph float32,bfloat16" "tensorflow xla float32" "jax xla float32"; do
  set -- $cfg
  for lib in base main; do
    PYTHONPATH=/work/$lib python benchmarks/bench_linear_cross_entropy.py --backend=$1 --mode=$2 --dtypes=$3 $LCE \
      --out=$OUT/lce_$1_$2_${lib}_$round.json > $OUT/lce_$1_$2_${lib}_$round.log 2>&1
  done
done
for lib in base main; do
  PYTHONPATH=/work/$lib python benchmarks/bench_chunked.py --backend=tensorflow,jax --n 2048 --v 100000 --baselines= \
    --repeats 3 --json $OUT/chunked_${lib}_$round.json > $OUT/chunked_${lib}_$round.log 2>&1
done
done
echo ALLDONE > $OUT/done
