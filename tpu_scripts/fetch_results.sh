#!/usr/bin/env bash
# Copies results.json, config.json, model.keras, the TensorBoard logs and the
# log file from the TPU VM to LOCAL_RESULTS_DIR.
set -euo pipefail
source "$(dirname "$0")/config.sh"
mkdir -p "$LOCAL_RESULTS_DIR"
for f in results.json config.json model.keras train.log; do
  gcloud compute tpus tpu-vm scp "$TPU_NAME":"$REMOTE_MODEL_DIR/$f" "$LOCAL_RESULTS_DIR/" \
    --project="$PROJECT" --zone="$ZONE" --worker=0
done
gcloud compute tpus tpu-vm scp --recurse "$TPU_NAME":"$REMOTE_MODEL_DIR/tensorboard" \
  "$LOCAL_RESULTS_DIR/" --project="$PROJECT" --zone="$ZONE" --worker=0 || true
echo "Results in $LOCAL_RESULTS_DIR"
