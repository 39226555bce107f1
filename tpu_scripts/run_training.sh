#!/usr/bin/env bash
# Runs examples/train_lm.py on the TPU VM: with TPUStrategy (BACKEND=tensorflow,
# the default), or on JAX over the TPU cores (BACKEND=jax: data-parallel, or
# with VOCAB_SHARDS=m the vocabulary split over m cores). Extra arguments are
# passed to the script, e.g.
#   ./run_training.sh --preset=zaremba_small --dataset=ptb --data_dir=data/ptb
# The run writes checkpoints to REMOTE_MODEL_DIR; if the VM or the ssh session
# dies, rerunning the same command resumes from the last checkpoint.
set -euo pipefail
source "$(dirname "$0")/config.sh"
args=""
for a in "$@"; do args+=" $(printf '%q' "$a")"; done
if [[ "$BACKEND" == "jax" ]]; then
  if [[ -n "$VOCAB_SHARDS" ]]; then
    strategy="--strategy=model_parallel --vocab_shards=$(printf '%q' "$VOCAB_SHARDS")"
  else
    strategy="--strategy=data_parallel"
  fi
  launch="KERAS_BACKEND=jax python3 examples/train_lm.py $strategy"
else
  launch="python3 examples/train_lm.py --strategy=tpu --tpu=local"
fi
tpu_ssh "set -o pipefail; mkdir -p $REMOTE_MODEL_DIR && cd $REMOTE_DIR && $launch \
  --steps_per_execution=${STEPS_PER_EXECUTION:-50} \
  --model_dir=$REMOTE_MODEL_DIR --verbose=2 $args 2>&1 | tee -a $REMOTE_MODEL_DIR/train.log"
