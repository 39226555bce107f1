#!/usr/bin/env bash
# Deletes the TPU VM (and everything on it: fetch the results first).
set -euo pipefail
source "$(dirname "$0")/config.sh"
gcloud compute tpus tpu-vm delete "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" --quiet
