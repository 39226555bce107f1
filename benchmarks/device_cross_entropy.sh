#!/usr/bin/env bash
# Issue 29's side-by-side table on one GPU (JAX, no TensorFlow), one call:
# PyTorch dense, Liger-Kernel 0.8.5 and Cut Cross-Entropy 25.1.1 (PyTorch on
# CUDA; triton comes with CUDA PyTorch), XLA dense, ours (the Pallas kernel,
# implementation "auto"), ours with filter_eps and today's tiled pass, at the
# Gemma 2 2B shape (bfloat16, float32) and N=4096 d=1024 V=131072 (float32);
# first the kernel against the tiled pass for every option at a small shape
# (Triton lowering + exactness), then ours with 128 x 128 blocks at the Gemma
# bfloat16 shape. Sized for about 5 minutes on an H100 (timeouts 120 + 330 + 110 s: under the 600 s of one device command).
# Wheels in .whl/ (untracked, not git-ignored: carried with the working tree;
# benchmarks/device_env.sh installs them all with --no-deps): Keras and its two
# missing dependencies (as for device_linear_cross_entropy.sh) plus
#   pip download --no-deps liger-kernel==0.8.5 cut-cross-entropy==25.1.1 -d .whl
# (both need only torch and triton). A missing peer's rows are recorded as skipped.
# usage: benchmarks/device_cross_entropy.sh OUT_DIR   (e.g. $OUT)
set -uo pipefail
out=${1:?OUT_DIR}
source benchmarks/device_env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, torch.cuda.is_available(), 'triton', triton.__version__)"
python3 -c "import liger_kernel, cut_cross_entropy; print('liger + cce import')" \
    || echo "a peer's wheel is missing: its rows are skipped"
# 1. The kernel against the tiled pass, every option (its own process: a Triton
#    failure here does not stop the table).
timeout 120 python3 benchmarks/bench_gpu_cross_entropy.py --check_options --shapes= \
    --out=$out/option_checks.json 2>&1 | tee $out/option_checks_log.txt
echo "option checks exit ${PIPESTATUS[0]}"
# 2. The table: every row, the three cases, one process.
timeout 330 python3 benchmarks/bench_gpu_cross_entropy.py \
    --out=$out/bench_gpu_cross_entropy.json 2>&1 | tee $out/run_log.txt
echo "bench exit ${PIPESTATUS[0]}"
# 3. Larger kernel blocks at the Gemma shape (bfloat16), against XLA dense.
timeout 110 python3 benchmarks/bench_gpu_cross_entropy.py --blocks=128,128,64 \
    --shapes=8192x2304x256000:bfloat16 --rows=xla_dense,ours,ours_filtered \
    --out=$out/bench_gpu_cross_entropy_blocks128.json 2>&1 | tee $out/blocks128_log.txt
echo "blocks128 exit ${PIPESTATUS[0]}"
ls -la $out
