#!/usr/bin/env bash
# Creates the TPU VM.
set -euo pipefail
source "$(dirname "$0")/config.sh"
gcloud compute tpus tpu-vm create "$TPU_NAME" \
  --project="$PROJECT" \
  --zone="$ZONE" \
  --accelerator-type="$ACCELERATOR_TYPE" \
  --version="$RUNTIME_VERSION"
gcloud compute tpus tpu-vm describe "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
  --format="value(state,acceleratorType)"
