#!/usr/bin/env bash
# Copies the repository (and DATA_DIR, if set) to the TPU VM and installs it.
#
# BACKEND=tensorflow (the default): the package pins `tensorflow==2.21.*`,
# which on PyPI is the CPU/GPU build; a TPU needs the TPU build of the same
# version (`tensorflow-tpu` + libtpu). So the package is installed with
# --no-deps, next to `tensorflow-tpu` from the libtpu wheel index, and its
# other dependencies are installed explicitly.
# BACKEND=jax: the package with its dependencies (TensorFlow's CPU build runs
# the tf.data input pipeline on the host), then `jax[tpu]==JAX_VERSION` with
# its libtpu, which drives the TPU.
set -euo pipefail
source "$(dirname "$0")/config.sh"

archive="$(mktemp -d)/keras-softmax-heads.tar.gz"
git -C "$REPO_ROOT" ls-files -co --exclude-standard -z \
  | tar -C "$REPO_ROOT" --null -T - -czf "$archive"
gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME":/tmp/ksh.tar.gz \
  --project="$PROJECT" --zone="$ZONE" --worker=all
if [[ -n "$DATA_DIR" ]]; then
  tpu_ssh "mkdir -p $REMOTE_DIR/data"
  gcloud compute tpus tpu-vm scp --recurse "$DATA_DIR" "$TPU_NAME":"$REMOTE_DIR/data/" \
    --project="$PROJECT" --zone="$ZONE" --worker=all
fi
if [[ "$BACKEND" == "jax" ]]; then
  install="python3 -m pip install -e $REMOTE_DIR tensorboard
  python3 -m pip install 'jax[tpu]==$JAX_VERSION' \
    -f https://storage.googleapis.com/jax-releases/libtpu_releases.html
  KERAS_BACKEND=jax python3 -c 'import jax, keras, keras_softmax_heads; print(jax.__version__, keras.__version__, jax.devices())'"
else
  install="python3 -m pip install 'tensorflow-tpu==$TF_VERSION' \
    -f https://storage.googleapis.com/libtpu-tf-releases/index.html
  python3 -m pip install 'keras>=3.12,<4' 'absl-py>=2.1' 'numpy>=1.26' \
    'tensorflow-datasets>=4.9.9' 'scikit-learn>=1.5' tensorboard
  python3 -m pip install --no-deps -e $REMOTE_DIR
  python3 -c 'import tensorflow as tf, keras, keras_softmax_heads; print(tf.__version__, keras.__version__)'"
fi
tpu_ssh "set -e
  mkdir -p $REMOTE_DIR && tar -xzf /tmp/ksh.tar.gz -C $REMOTE_DIR
  python3 -m pip install --upgrade pip
  $install"
