# Sourced by run.sh and run_train_on_batch.sh: `alternate FILE PROCS PIN SCRIPT ARGS...` runs
# SCRIPT (in this folder) PROCS times with the package at OLD (default f13bbae, a temporary git
# worktree) and with this checkout, alternated, each process's last stdout line appended to FILE.
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd); ROOT=$(cd "$HERE/../../../.." && pwd)
alternate() {
  local file=$1 procs=$2 pin=$3 script=$4; shift 4
  local old_tree; old_tree=$(mktemp -d)/old
  git -C "$ROOT" worktree add -q "$old_tree" "${OLD:-f13bbae}"
  : > "$file"
  for i in $(seq "$procs"); do
    for tree in "$old_tree" "$ROOT"; do
      PYTHONPATH="$tree" KERAS_BACKEND=torch TF_CPP_MIN_LOG_LEVEL=3 $pin python "$HERE/$script" "$@" 2>/dev/null | tail -1 >> "$file"
    done
  done
  git -C "$ROOT" worktree remove --force "$old_tree"
}
