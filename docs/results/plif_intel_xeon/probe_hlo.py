"""XLA's optimized HLO of `probe_split.py`'s `plif_g` (the fused loss and its gradients)
into the file given, with counts of a few of its instructions.

    OMP_NUM_THREADS=1 python probe_hlo.py plif_g.hlo
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_split import plif_g, z  # noqa: E402

hlo = plif_g.experimental_get_compiler_ir(z)(stage="optimized_hlo")
with open(sys.argv[1], "w") as f:
    f.write(hlo)
print(len(hlo.splitlines()))
for op in ["scatter", "sort", "gather", "while", "fusion", "copy(", "dynamic-update-slice",
           "custom-call", "transpose", "reduce("]:
    print(op, hlo.count(" " + op))
