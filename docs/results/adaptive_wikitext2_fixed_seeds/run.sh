#!/bin/bash
# §2.7 rerun on the fixed code (clone /work/study at 2446d80): adaptive beside hsm, then softmax beside softmax.
. /work/venv/bin/activate
cd /work/study
D=/work/wt2_rerun; mkdir -p $D
common="--study=adaptive_wikitext2 --loop=tf_data --dataset=wikitext2 --data_dir=/work/shared/data/wikitext-2"
PYTHONPATH=/work/study python benchmarks/parallel_study.py $common --rows=adaptive,hsm --cores=0,1 \
  --runs_dir=$D/a --out=$D/a/study.json > $D/a.log 2>&1
PYTHONPATH=/work/study python benchmarks/parallel_study.py $common --rows=softmax --cores=0 \
  --runs_dir=$D/b0 --out=$D/b0/study.json > $D/b0.log 2>&1 &
PYTHONPATH=/work/study python benchmarks/parallel_study.py $common --rows=softmax --cores=1 \
  --runs_dir=$D/b1 --out=$D/b1/study.json > $D/b1.log 2>&1 &
wait
echo done > $D/DONE
