"""XLA's optimized HLO of probe_split.py's `plif_g` (the fused loss and its gradients), with counts
of a few instructions; writes plif_g.hlo beside the working directory's /work/plif49 (edit the path)."""
import os, sys, re
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.argv = [sys.argv[0], "/dev/null"]
exec(open("/work/main/docs/results/plif_intel_xeon/probe_split.py").read().split("rows = {")[0])
hlo = plif_g.experimental_get_compiler_ir(z)(stage="optimized_hlo")
open("/work/plif49/plif_g.hlo", "w").write(hlo)
print(len(hlo.splitlines()))
for op in ["scatter", "sort", "gather", "while", "fusion", "copy(", "dynamic-update-slice", "custom-call", "transpose", "reduce("]:
    print(op, hlo.count(" " + op))
