#!/bin/bash
# A/B after the gradient buffers stopped being compile-time constants (dispatch.zeros_like):
# base (b3ae0db, /work/base) vs main (a snapshot worktree, /work/snap3), the snapshot's
# benchmark scripts for both, interleaved per configuration, one fresh process per row.
cd /work/snap3
. /work/venv/bin/activate
export OMP_NUM_THREADS=2 TF_CPP_MIN_LOG_LEVEL=3
OUT=${OUT:-/work/ab3/out}; mkdir -p $OUT
LCE="--tokens=2048 --dim=1024 --vocab_sizes=65536 --rows=ours --threads=2 --repeats=3"
for round in 1 2; do
for cfg in "xla float32" "graph float32" "xla bfloat16" "graph bfloat16"; do
  set -- $cfg
  for lib in base main; do
    PYTHONPATH=/work/$([ $lib = main ] && echo snap3 || echo base) python benchmarks/bench_linear_cross_entropy.py --backend=tensorflow --mode=$1 --dtypes=$2 $LCE \
      --out=$OUT/lce_tensorflow_$1_$2_${lib}_$round.json > $OUT/lce_tensorflow_$1_$2_${lib}_$round.log 2>&1
  done
done
for lib in base main; do
  PYTHONPATH=/work/$([ $lib = main ] && echo snap3 || echo base) python benchmarks/bench_chunked.py --backend=tensorflow --n 2048 --v 100000 --baselines= \
    --repeats 3 --json $OUT/chunked_${lib}_$round.json > $OUT/chunked_${lib}_$round.log 2>&1
done
done
echo ALLDONE > $OUT/done
