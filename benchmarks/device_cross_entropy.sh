#!/usr/bin/env bash
# Issue 29's GPU half in one call (JAX, no TensorFlow): first the kernel
# against the tiled pass for every option at a small shape (Triton lowering
# + exactness); then the side-by-side table: PyTorch dense, Liger-Kernel
# 0.8.5 and Cut Cross-Entropy 25.1.1 (PyTorch on CUDA; triton comes with CUDA
# PyTorch), XLA dense, ours (the Pallas kernel, implementation "pallas"), ours
# with filter_eps, the tiled pass (the library's default since the first
# GPU run) and the tiled pass over token blocks (`token_chunk_size`, the
# lean two-pass backward) and the gradient in the forward pass
# (`gradient_in_forward`, three products), at the Gemma 2 2B shape (bfloat16,
# float32) and N=4096 d=1024 V=131072 (float32); then a keras-hub Gemma
# training step, stock against fused (time, and the longest sequence that
# fits, by XLA's compiled memory). Bounded at about 410 s in all (hard
# `timeout`s 60 + 180 + 140 s; each table rewrites its JSON as it goes and
# begins nothing new after its --max_seconds), so that this call and
# device_heads.sh's fit one session's 15 minutes of device time with the
# machine's start. Four files in OUT_DIR. BLOCK_SWEEP=1 instead runs only the
# kernel with (128, 128, 64) blocks and the token-blocked pass at three tile
# shapes, at the Gemma bfloat16 shape, and the gradient in the forward pass
# with chunks of 4,096 tokens (bfloat16 and float32) (a third call of about
# 240 s, if the session's time allows).
# Wheels in .whl/ (git-ignored; benchmarks/device_wheels.sh downloads them
# here, the device call names ".whl" in `carry`; benchmarks/device_env.sh
# installs them with --no-deps): Keras, namex, optree, keras-hub,
# liger-kernel and cut-cross-entropy. A missing peer's rows are recorded as
# skipped.
# usage: benchmarks/device_cross_entropy.sh OUT_DIR   (e.g. $OUT)
set -uo pipefail
out=${1:?OUT_DIR}
mkdir -p "$out"
log=$out/cross_entropy_log.txt
{
source benchmarks/device_env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, torch.cuda.is_available(), 'triton', triton.__version__)"
python3 -c "import liger_kernel, cut_cross_entropy; print('liger + cce import')" \
    || echo "a peer's wheel is missing: its rows are skipped"
if [ "${BLOCK_SWEEP:-0}" = 1 ]; then
  # The kernel with (128, 128, 64) blocks (the best of the first run's
  # sweep), then the tiled pass over token blocks at three tile shapes, at
  # the Gemma shape (bfloat16), each against XLA dense in its own process.
  for blocks in 128,128,64; do
    timeout 60 python3 benchmarks/bench_gpu_cross_entropy.py --blocks=$blocks \
        --shapes=8192x2304x256000:bfloat16 --rows=xla_dense,ours,ours_filtered,ours_tiled --repeats=5 \
        --out=$out/bench_gpu_cross_entropy_blocks_${blocks//,/_}.json
    echo "blocks $blocks exit $?"
  done
  # Token blocks (tokens x words per tile) around the table's 2,048 x 2,048:
  # time against memory of the two-pass backward.
  for blocked in 1024x2048 2048x1024 4096x4096; do
    timeout 60 python3 benchmarks/bench_gpu_cross_entropy.py \
        --token_chunk_size=${blocked%x*} --blocked_chunk_size=${blocked#*x} \
        --shapes=8192x2304x256000:bfloat16 --rows=xla_dense,ours_blocked --repeats=5 \
        --out=$out/bench_gpu_cross_entropy_blocked_${blocked}.json
    echo "blocked $blocked exit $?"
  done
  # The gradient in the forward pass with chunks of 4,096 tokens (the
  # table's row takes the library's GPU default, 1,048 at V = 256,000).
  timeout 60 python3 benchmarks/bench_gpu_cross_entropy.py --summed_token_chunk_size=4096 \
      --shapes=8192x2304x256000:bfloat16,8192x2304x256000:float32 --rows=xla_dense,ours_summed \
      --repeats=5 --out=$out/bench_gpu_cross_entropy_summed_4096.json
  echo "summed 4096 exit $?"
else
  # 1. The kernel against the tiled pass, every option (its own process: a
  #    Triton failure here does not stop the table).
  timeout 60 python3 benchmarks/bench_gpu_cross_entropy.py --check_options --shapes= \
      --out=$out/option_checks.json
  echo "option checks exit $?"
  # 2. The table: every row, the three cases (the bfloat16 Gemma case first).
  timeout 180 python3 benchmarks/bench_gpu_cross_entropy.py --max_seconds=130 \
      --out=$out/bench_gpu_cross_entropy.json
  echo "bench exit $?"
  # 3. The keras-hub Gemma step, stock against fused (token blocks of 4,096:
  #    the same step at 2,048 tokens, the loss's memory flat in the probes).
  timeout 140 python3 benchmarks/bench_gpu_causal_lm.py --max_seconds=110 \
      --fused_loss='{"token_chunk_size": 4096}' --out=$out/bench_gpu_causal_lm.json
  echo "causal lm exit $?"
fi
ls -la $out
} 2>&1 | tee "$log"
