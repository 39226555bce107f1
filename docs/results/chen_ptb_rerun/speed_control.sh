#!/bin/bash
# Old (534a062) vs new (a clone at 2446d80) code, one row each on its own core, simultaneously
# (taskset and the thread variables by hand: 534a062 predates parallel_study.py --cores).
. /work/venv/bin/activate
export TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=2 OMP_NUM_THREADS=1
run() { # tree core row head opts tag
  local tree=$1 core=$2 row=$3 head=$4 opts=$5 tag=$6
  (cd $tree && PYTHONPATH=$tree taskset -c $core python examples/train_lm.py --preset=chen_ptb_ngram --dataset=ptb \
     --data_dir=/work/shared/data/ptb --head=$head ${opts:+--head_options=$opts} --train_seconds=90 \
     --model_dir=/work/ctrl/$tag --overwrite > /work/ctrl/$tag.log 2>&1)
}
for spec in "sampling sampled_softmax num_sampled=1024" "hsm_random hierarchical clustering=random" "softmax full_softmax "; do
  set -- $spec
  row=$1 head=$2 opts=$3
  for swap in 0 1; do
    if [ $swap = 0 ]; then oc=0 nc=1; else oc=1 nc=0; fi
    run /work/old534 $oc $row $head "$opts" ${row}_old_$swap &
    run /work/study $nc $row $head "$opts" ${row}_new_$swap &
    wait
  done
done
echo done
