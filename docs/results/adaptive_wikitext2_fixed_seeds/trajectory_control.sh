#!/bin/bash
# The adaptive WikiText-2 row's first 1,000 steps with the first study's code (1056e2f) and today's
# (a clone at 2446d80), side by side, one core each; epochs of 200 steps. (taskset and the thread
# variables by hand, not parallel_study.py --cores: the first study's tree predates that flag.)
. /work/venv/bin/activate
export TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=2 OMP_NUM_THREADS=1
run() { local tree=$1 core=$2 tag=$3
  (cd $tree && PYTHONPATH=$tree taskset -c $core python examples/train_lm.py --preset=adaptive_wikitext2 \
     --dataset=wikitext2 --data_dir=/work/shared/data/wikitext-2 --head=adaptive \
     '--head_options=cutoffs=[2000, 10000],factor=4' --steps_per_epoch=200 --epochs=5 \
     --train_seconds=100000 --eval_steps=20 --model_dir=/work/ctrl/$tag --overwrite > /work/ctrl/$tag.log 2>&1)
}
run /work/old1056 0 adaptive_1056e2f &
run /work/study 1 adaptive_2446d80 &
wait
echo done
