#!/usr/bin/env bash
# The converged bottleneck study (issue 19) on a GPU machine with JAX and no
# TensorFlow: all rows at once (benchmarks/parallel_study.py, the arrays
# loop). Keras and its two missing dependencies travel as wheels in .whl/,
# PTB in .gpu_data/ptb; the rows' work directories stay in .gpu_runs/ (a
# rerun on the same machine resumes them at the last finished epoch).
# usage: benchmarks/device_bottleneck_converged.sh OUT_DIR [SECONDS] [STUDY]
# (STUDY: bottleneck_ptb_converged, or bottleneck_ptb_regularized)
set -uo pipefail
out=${1:?OUT_DIR}; seconds=${2:-470}; study=${3:-bottleneck_ptb_converged}
source benchmarks/device_env.sh
runs=.gpu_runs/$study
mkdir -p $runs
timeout $seconds python3 benchmarks/parallel_study.py --study=$study \
    --loop=arrays --data_dir=.gpu_data/ptb --runs_dir=$runs \
    --out=$runs/study_$study.json --overrides=unroll=True
echo "parallel_study exit $?"
for f in $runs/*.log; do echo "== $f"; grep -E "^epoch|test perplexity|Error" $f | cut -c1-220 | tail -7; done
cp $runs/study_$study.json $out/ 2>/dev/null
tar czf $out/runs.tgz $runs/*.log $runs/*.json $runs/*/state.json $runs/*/results.json 2>/dev/null
ls -la $out
