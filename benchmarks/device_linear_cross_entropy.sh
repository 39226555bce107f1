#!/usr/bin/env bash
# Issue 20's fused linear cross-entropy table on a GPU machine (JAX, no
# TensorFlow): Keras' dense logits + SparseCategoricalCrossentropy and ours
# on JAX's GPU, PyTorch's dense and chunked losses on CUDA, each row a fresh
# process (benchmarks/bench_linear_cross_entropy.py --device=gpu). Keras and
# its two missing dependencies travel as wheels in .whl/.
# usage: benchmarks/device_linear_cross_entropy.sh OUT_DIR
set -uo pipefail
out=${1:?OUT_DIR}
source benchmarks/device_env.sh
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
bench="python3 benchmarks/bench_linear_cross_entropy.py --backend=jax --device=gpu --memory_budget_gb=100 --repeats=5"
# The CPU table's shapes.
$bench --tokens=4096 --dim=1024 --vocab_sizes=32768,131072,262144 --dtypes=float32,bfloat16 \
    --out=$out/bench_linear_cross_entropy_gpu.json
# Cut Cross-Entropy's Gemma 2 (2B) shape: 8,192 tokens, d = 2304, V = 256,000.
$bench --tokens=8192 --dim=2304 --vocab_sizes=256000 --dtypes=bfloat16,float32 \
    --out=$out/bench_linear_cross_entropy_gpu_gemma2.json
# Our tile width on a GPU: 16,384 and 32,768 words.
for c in 16384 32768; do
  $bench --rows=ours --chunk_size=$c --tokens=8192 --dim=2304 --vocab_sizes=256000 \
      --dtypes=bfloat16,float32 --out=$out/bench_linear_cross_entropy_gpu_gemma2_chunk$c.json
done
ls -la $out
