# The A/B of session 51: the package at OLD (default f13bbae, the per-tile in-place functions under
# `ops.scan`) against this checkout (`plif_torch`'s loops), alternated processes, PROCS pairs,
# one thread pinned to core 0 (THREADS=2: both cores, unpinned). Output: OUT/ab_v{V}_d{d}_t{THREADS}.jsonl
#   bash run.sh V d [PROCS] [ROUNDS]
set -e
source "$(dirname "$0")/alternate.sh"
V=$1; D=$2; PROCS=${3:-3}; ROUNDS=${4:-4}; THREADS=${THREADS:-1}; OUT=${OUT:-$HERE}
PIN="taskset -c 0"; [ "$THREADS" = 1 ] || PIN=""
FILE="$OUT/ab_v${V}_d${D}_t${THREADS}.jsonl"
alternate "$FILE" "$PROCS" "$PIN" step.py "$V" "$D" "$ROUNDS" "$THREADS"
python - "$FILE" <<'PY'
import json, sys, numpy as np
rows = [json.loads(l) for l in open(sys.argv[1])]
for label, rs in (("old", rows[0::2]), ("new", rows[1::2])):
    print(label, "plif/full per process", [round(r["plif_over_full"], 3) for r in rs],
          {k: round(float(np.median([r["median_ms"][k] for r in rs])), 1) for k in rs[0]["median_ms"]})
PY
