#!/usr/bin/env bash
# Settings shared by the TPU scripts. Override any of them in the environment:
#   PROJECT=my-project ZONE=us-central2-b TPU_NAME=ksh-lm ./run_all.sh --preset=zaremba_small ...
# Not runnable from the development sandbox (no Google Cloud access); written to
# the Cloud TPU documentation (TPU VM architecture, TensorFlow PJRT runtime).

PROJECT="${PROJECT:-$(gcloud config get-value project 2>/dev/null)}"
ZONE="${ZONE:-us-central1-a}"
TPU_NAME="${TPU_NAME:-ksh-train-lm}"
# A single-host slice: the training script uses the TPU cores of one TPU VM.
ACCELERATOR_TYPE="${ACCELERATOR_TYPE:-v5litepod-8}"
# The Keras backend on the TPU: "tensorflow" (tf.distribute.TPUStrategy, the
# default) or "jax" (a keras.distribution over the TPU cores:
# --strategy=data_parallel, or with VOCAB_SHARDS=m --strategy=model_parallel
# --vocab_shards=m, the embedding, the output layer and their optimizer state
# split on the vocabulary over m cores).
BACKEND="${BACKEND:-tensorflow}"
case "$BACKEND" in
  tensorflow|jax) ;;
  *) echo "BACKEND must be tensorflow or jax. Received: BACKEND=$BACKEND" >&2; exit 2 ;;
esac
# VOCAB_SHARDS (BACKEND=jax only): the cores the vocabulary is split over;
# empty: data-parallel over all the cores.
VOCAB_SHARDS="${VOCAB_SHARDS:-}"
if [[ -n "$VOCAB_SHARDS" && "$BACKEND" != "jax" ]]; then
  echo "VOCAB_SHARDS needs BACKEND=jax (keras.distribution). Received:" \
    "BACKEND=$BACKEND VOCAB_SHARDS=$VOCAB_SHARDS" >&2
  exit 2
fi
# TensorFlow TPU VM images are named tpu-vm-tf-X.Y.Z-pjrt (single host) or
# tpu-vm-tf-X.Y.Z-pod-pjrt (multi-host); JAX runs on the base image
# (tpu-ubuntu2204-base). List them with:
#   gcloud compute tpus tpu-vm versions list --zone="$ZONE"
# Pick the newest TensorFlow one; install.sh then installs the matching
# tensorflow-tpu wheel (TF_VERSION) if the image's TensorFlow differs, or
# with BACKEND=jax the jax[tpu] wheel (JAX_VERSION, with its libtpu).
if [[ "$BACKEND" == "jax" ]]; then
  RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-ubuntu2204-base}"
else
  RUNTIME_VERSION="${RUNTIME_VERSION:-tpu-vm-tf-2.18.0-pjrt}"
fi
TF_VERSION="${TF_VERSION:-2.21.*}"
JAX_VERSION="${JAX_VERSION:-0.10.2}"
# Where the repository and the results live on the TPU VM.
REMOTE_DIR="${REMOTE_DIR:-~/keras-softmax-heads}"
REMOTE_MODEL_DIR="${REMOTE_MODEL_DIR:-~/runs/train_lm}"
# Optional local corpus directory to copy to the VM (e.g. ../shared/data/ptb):
# it lands in $REMOTE_DIR/data/<its name>, so pass e.g. --data_dir=data/ptb
# (relative to the repository, where run_training.sh runs the script).
DATA_DIR="${DATA_DIR:-}"
# Where fetch_results.sh puts the results on this machine.
LOCAL_RESULTS_DIR="${LOCAL_RESULTS_DIR:-./tpu_results/${TPU_NAME}}"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

tpu_ssh() {
  gcloud compute tpus tpu-vm ssh "$TPU_NAME" --project="$PROJECT" --zone="$ZONE" \
    --worker=all --command="$1"
}
