#!/bin/bash
# usage: study_queue.sh CORE STUDY ROW [ROW ...]   (one row per process, resumable: a row whose out exists is skipped)
CORE=$1; STUDY=$2; DATASET=$3; DATA_DIR=$4; shift 4
. /work/venv/bin/activate
cd /work/study
export PYTHONPATH=/work/study TF_NUM_INTRAOP_THREADS=1 TF_NUM_INTEROP_THREADS=2 OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2
for ROW in "$@"; do
  OUT=/work/study_runs/out/${STUDY}__${ROW}.json
  [ -f "$OUT" ] && continue
  echo "$(date -u +%H:%M:%S) start $ROW" >> /work/study_runs/queue_$CORE.log
  taskset -c $CORE python examples/paper_comparisons.py --study=$STUDY --rows=$ROW --dataset=$DATASET \
    --data_dir=$DATA_DIR --runs_dir=/work/study_runs/$STUDY --out=$OUT.tmp \
    > /work/study_runs/${STUDY}__${ROW}.log 2>&1 && mv $OUT.tmp $OUT
  echo "$(date -u +%H:%M:%S) end $ROW rc=$?" >> /work/study_runs/queue_$CORE.log
done
