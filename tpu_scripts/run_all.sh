#!/usr/bin/env bash
# Create the VM, install, train (arguments go to train_lm.py), fetch the
# results, delete the VM. The VM is deleted even if a step fails (set
# KEEP_VM=1 to keep it, e.g. to resume a failed run with run_training.sh).
set -euo pipefail
here="$(dirname "$0")"
source "$here/config.sh"
cleanup() {
  if [[ "${KEEP_VM:-0}" != "1" ]]; then
    "$here/fetch_results.sh" || echo "fetching the results failed" >&2
    "$here/delete_vm.sh"
  fi
}
"$here/create_vm.sh"
trap cleanup EXIT
"$here/install.sh"
"$here/run_training.sh" "$@"
