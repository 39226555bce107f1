# PLIFSoftmax's Keras train_on_batch, the package at OLD (default f13bbae) and this checkout in
# alternated processes (PROCS pairs), one thread pinned to core 0. Output: OUT/train_on_batch_v{V}.jsonl
#   bash run_train_on_batch.sh [V] [PROCS] [STEPS]
set -e
source "$(dirname "$0")/alternate.sh"
V=${1:-32768}; PROCS=${2:-3}; STEPS=${3:-5}; OUT=${OUT:-$HERE}
FILE="$OUT/train_on_batch_v${V}.jsonl"
alternate "$FILE" "$PROCS" "taskset -c 0" train_on_batch.py "$V" "$STEPS"
python - "$FILE" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for label, rs in (("old", rows[0::2]), ("new", rows[1::2])):
    print(label, [round(r["median_s"], 2) for r in rs], "range", round(min(min(r["steps_s"]) for r in rs), 2), "-", round(max(max(r["steps_s"]) for r in rs), 2))
PY
