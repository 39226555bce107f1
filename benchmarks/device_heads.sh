#!/usr/bin/env bash
# Issue 28's one-call GPU table (JAX, no TensorFlow): every exact head's
# training step against FullSoftmax's in the same process (median wall time,
# ratio, XLA's compiled memory), d = 512, N = 8,192, V = 33,278 (with
# torch.compile of FullSoftmax and of the PLIF formula) and V = 100,000
# (without the [N, K, V] reference MoS, which asks for 45.8 GiB there).
# Sized for about 5 minutes on one H100 (each call stops timing new heads
# after --max_seconds). Keras and its two missing dependencies travel as
# wheels in .whl/ (benchmarks/device_env.sh).
# usage: benchmarks/device_heads.sh [OUT_DIR]   (default docs/results/device_heads)
set -uo pipefail
out=${1:-docs/results/device_heads}
mkdir -p "$out"
source benchmarks/device_env.sh
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
bench="python3 benchmarks/bench_device_heads.py --tokens=8192 --dim=512 --rounds=7 --warmup=2"
$bench --vocab_sizes=33278 --torch --max_seconds=150 --out=$out/device_heads_v33278.json
$bench --vocab_sizes=100000 --max_seconds=120 \
    --heads=full,plif,plif_k1000,sigsoftmax,monotonic,mos15,mos4,moss15,mos4_plif,moc15 \
    --out=$out/device_heads_v100000.json
ls -la "$out"
