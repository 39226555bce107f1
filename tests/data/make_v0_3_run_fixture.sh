#!/usr/bin/env bash
# Writes tests/data/v0_3_mos_run/ with keras-softmax-heads 0.3.0 (commit b3ae0db):
# a MixtureOfSoftmaxes training run (0.3.0's default head: with a latent bias)
# killed after its mid-epoch checkpoint of step 3 (checkpoints/, config.json),
# and expected.json, the same run uninterrupted (its validation and test NLL and
# training losses). Run from the repository root of that commit:
# `bash tests/data/make_v0_3_run_fixture.sh OUT_DIR`, then copy OUT_DIR/killed's
# checkpoints/ and config.json, and OUT_DIR/expected.json, here.
set -euo pipefail
out=${1:?usage: make_v0_3_run_fixture.sh OUT_DIR}
export TF_CPP_MIN_LOG_LEVEL=3 CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 PYTHONPATH=$PWD
flags=(--dataset_options=vocab_size=40,num_train_tokens=3000,num_valid_tokens=400,num_test_tokens=401
       --embedding_dim=8 --hidden_size=8 --num_layers=1 --batch_size=4 --bptt=6 --epochs=2
       --steps_per_epoch=5 --verbose=0 --num_diagnostic_contexts=50 --head=mos
       --head_options=num_components=2 --checkpoint_every=3)
python examples/train_lm.py --model_dir="$out/killed" "${flags[@]}" --kill_after_steps=4 || true
python examples/train_lm.py --model_dir="$out/fresh" "${flags[@]}"
python - "$out" <<'PY'
import json, sys
a = json.load(open(f"{sys.argv[1]}/fresh/results.json"))
json.dump({"written_by": "keras-softmax-heads 0.3.0 (commit b3ae0db), tests/data/make_v0_3_run_fixture.sh",
           "uninterrupted": {"valid_nll": a["valid"]["nll"], "test_nll": a["test"]["nll"],
                             "train_loss": [h["train_loss"] for h in a["history"]]}},
          open(f"{sys.argv[1]}/expected.json", "w"), indent=1)
PY
