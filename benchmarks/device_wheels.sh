#!/usr/bin/env bash
# Run HERE (a machine that reaches the package registries), before a device
# call: downloads into .whl/ the wheels the GPU machine lacks for the
# device_*.sh scripts (its image has JAX, PyTorch and Triton but no Keras):
# Keras and its two dependencies missing there (namex, optree), keras-hub
# (for the Gemma step; it imports without TensorFlow, tensorflow-text and
# kagglehub, which it lacks there), and the issue-29 peers Liger-Kernel and
# Cut Cross-Entropy (pinned; both need only torch and triton). Python 3.12
# x86-64 wheels (the device's python3).
# .whl/ is git-ignored: name it in the device call's `carry` (".whl").
# usage: benchmarks/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=" --platform $p"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $platforms -d .whl \
    keras==3.15.1 namex==0.1.0 optree==0.20.0 keras-hub==0.32.0 liger-kernel==0.8.5 \
    cut-cross-entropy==25.1.1
ls -la .whl
du -sh .whl
