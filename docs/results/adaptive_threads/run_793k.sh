#!/bin/bash
# V = 793,471 (lm1b, Transformer-XL's cutoffs) at 2 threads, one round: the static path before
# (229d9e8, /work/snap3) and after the saved first rung, the dynamic path and torch's module.
cd /work/main
. /work/venv/bin/activate
export TF_CPP_MIN_LOG_LEVEL=3 OMP_NUM_THREADS=2 TF_NUM_INTRAOP_THREADS=2 TF_NUM_INTEROP_THREADS=1
OUT=${OUT:-/work/adaptive_threads}; mkdir -p $OUT
PYTHONPATH=/work/snap3 python benchmarks/bench_adaptive.py --threads=2 --vocab_sizes=793471 --repeats=3 \
  --rows=static --phases=train --out=$OUT/before_t2_793k.json > $OUT/before_t2_793k.log 2>&1
python benchmarks/bench_adaptive.py --threads=2 --vocab_sizes=793471 --repeats=3 \
  --rows=static,dynamic,torch --phases=train --out=$OUT/after_t2_793k.json > $OUT/after_t2_793k.log 2>&1
echo ALLDONE > $OUT/done_793k
