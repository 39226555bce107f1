#!/usr/bin/env bash
# Issue 28's one-call GPU table (JAX, no TensorFlow): every exact head's
# training step against FullSoftmax's in the same process (median wall time,
# ratio, XLA's compiled memory), d = 512, N = 8,192, V = 33,278 (with
# torch.compile of FullSoftmax and of the PLIF formula) and V = 100,000
# (without the [N, K, V] reference MoS, which asks for 45.8 GiB there), the
# adaptive softmax last in both lists (its default path and its tails'
# gradients in the forward pass, on Zipfian targets: whether that option,
# off on a GPU by default, should be on there); then
# PLIF's slope histogram on each path (scatter; the scatter into interleaved
# copies, `spread`, at its default copies and at 32 and 1,024; sorted; the
# Pallas kernel and the fused backward tile, at the default 32 lanes, and
# the kernel at 16 and 64). Bounded at
# about 365 s in all (hard `timeout`s 170 + 90 + 75 s; each table stops
# starting heads after --max_seconds and saves its JSON as it goes), so
# that this call and device_cross_entropy.sh's fit one session's 15 minutes of
# device time with the machine's start. Four files in OUT_DIR (the device
# tool returns at most eight). Keras and its two missing dependencies travel
# as wheels in .whl/ (benchmarks/device_wheels.sh, then carry ".whl").
# usage: benchmarks/device_heads.sh [OUT_DIR]   (default docs/results/device_heads)
set -uo pipefail
out=${1:-docs/results/device_heads}
mkdir -p "$out"
log=$out/device_heads_log.txt
{
source benchmarks/device_env.sh
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())"
bench="python3 benchmarks/bench_device_heads.py --tokens=8192 --dim=512 --rounds=7 --warmup=2"
timeout 170 $bench --vocab_sizes=33278 --torch --max_seconds=110 \
    --heads=full,plif,plif_summed,plif_summed_spread,plif_spread,plif_scatter,plif_fused,plif_k1000,plif_k1000_summed,plif_k1000_summed_spread,plif_k1000_spread,plif_k1000_scatter,plif_k1000_fused,monotonic,monotonic_spread,mos15,mos4,mos15_summed,mos4_summed,sigsoftmax,sigsoftmax_summed,full_summed,moss15,moss15_summed,mos4_plif,mos4_plif_summed,mos4_plif_summed_spread,moc15,mos15_dense,adaptive,adaptive_summed \
    --out=$out/device_heads_v33278.json
echo "v33278 exit $?"
timeout 90 $bench --vocab_sizes=100000 --max_seconds=50 \
    --heads=full,plif,plif_summed,plif_summed_spread,plif_spread,plif_fused,plif_k1000,plif_k1000_spread,mos4,mos4_summed,sigsoftmax,sigsoftmax_summed,monotonic,mos15,moss15,mos4_plif,moc15,adaptive,adaptive_summed \
    --out=$out/device_heads_v100000.json
echo "v100000 exit $?"
timeout 75 python3 benchmarks/bench_plif_histogram.py --n 8192 \
    --methods scatter,spread,spread:32,spread:1024,pallas,pallas:16,pallas:64,pallas_fused,sorted --rows loss_grad,histogram \
    --out $out/plif_histogram_gpu_jax.json
echo "plif histogram exit $?"
ls -la "$out"
} 2>&1 | tee "$log"
