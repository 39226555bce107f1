# PLIFSoftmax's Keras train_on_batch, the package at OLD (default f13bbae) and this checkout in
# alternated processes (PROCS pairs), one thread pinned to core 0. Output: OUT/train_on_batch_v{V}.jsonl
#   bash run_train_on_batch.sh [V] [PROCS] [STEPS]
set -e
HERE=$(cd "$(dirname "$0")" && pwd); ROOT=$(cd "$HERE/../../../.." && pwd)
V=${1:-32768}; PROCS=${2:-3}; STEPS=${3:-5}; OLD=${OLD:-f13bbae}; OUT=${OUT:-$HERE}
OLD_TREE=$(mktemp -d)/old; git -C "$ROOT" worktree add -q "$OLD_TREE" "$OLD"
FILE="$OUT/train_on_batch_v${V}.jsonl"; : > "$FILE"
for i in $(seq "$PROCS"); do
  for tree in "$OLD_TREE" "$ROOT"; do
    PYTHONPATH="$tree" KERAS_BACKEND=torch TF_CPP_MIN_LOG_LEVEL=3 taskset -c 0 python "$HERE/train_on_batch.py" "$V" "$STEPS" 2>/dev/null | tail -1 >> "$FILE"
  done
done
git -C "$ROOT" worktree remove --force "$OLD_TREE"
python - "$FILE" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for label, rs in (("old", rows[0::2]), ("new", rows[1::2])):
    print(label, [round(r["median_s"], 2) for r in rs], "range", round(min(min(r["steps_s"]) for r in rs), 2), "-", round(max(max(r["steps_s"]) for r in rs), 2))
PY
