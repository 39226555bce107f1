#!/bin/bash
# A/B after the bf16 tile reader/writer: base (b3ae0db) vs main, interleaved, fresh process per row.
cd /work/snap
. /work/venv/bin/activate
export OMP_NUM_THREADS=2 TF_CPP_MIN_LOG_LEVEL=3
OUT=/work/ab2/out; mkdir -p $OUT
LCE="--tokens=2048 --dim=1024 --vocab_sizes=65536 --rows=ours --threads=2 --repeats=3"
for round in 1 2; do
for cfg in "graph bfloat16" "xla float32" "xla bfloat16"; do
  set -- $cfg
  for lib in base main; do
    PYTHONPATH=/work/$([ $lib = main ] && echo snap || echo base) python benchmarks/bench_linear_cross_entropy.py --backend=tensorflow --mode=$1 --dtypes=$2 $LCE \
      --out=$OUT/lce_tensorflow_$1_$2_${lib}_$round.json > $OUT/lce_tensorflow_$1_$2_${lib}_$round.log 2>&1
  done
done
done
echo ALLDONE > $OUT/done
