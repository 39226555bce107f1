"""`tpu_scripts/`, short of a Cloud TPU: a stand-in `gcloud` on the PATH
logs every call, and runs the command of `gcloud compute tpus tpu-vm ssh`
here (the TPU VM played by this machine), so that the scripts' settings,
their error messages and the training command they launch are checked.

With `BACKEND=jax VOCAB_SHARDS=2` the launched command trains
`examples/train_lm.py` with `--strategy=model_parallel --vocab_shards=2`
(on 4 simulated host devices standing in for the TPU cores); the default
(`BACKEND=tensorflow`) launches `--strategy=tpu --tpu=local` (not run: it
needs a TPU, `tests/test_distribute.py` checks its error without one);
`install.sh` installs `jax[tpu]` (JAX) or `tensorflow-tpu` (TensorFlow),
`create_vm.sh` picks the runtime image of the backend; bad settings stop
with the values received."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tpu_scripts"

GCLOUD = """#!/usr/bin/env bash
printf '%s\\0' "$*" >> "$GCLOUD_LOG"
if [[ "$*" == "config get-value project" ]]; then echo test-project; exit 0; fi
for a in "$@"; do
  case "$a" in
    --command=*) [[ "${GCLOUD_RUN_SSH:-0}" == 1 ]] && exec bash -c "${a#--command=}";;
  esac
done
exit 0
"""


@pytest.fixture
def run_script(tmp_path):
    """`run_script(name, *args, **env)`: runs `tpu_scripts/<name>` with the
    stand-in `gcloud` (and a `python3` that is this interpreter) first on
    the PATH; returns the process and the logged `gcloud` calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(GCLOUD)
    (bin_dir / "python3").write_text(f'#!/usr/bin/env bash\nexec {sys.executable} "$@"\n')
    for name in ("gcloud", "python3"):
        os.chmod(bin_dir / name, 0o755)
    log = tmp_path / "gcloud.log"

    def run(name, *args, timeout=60, **env):
        log.write_text("")
        full_env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                        GCLOUD_LOG=str(log), TF_CPP_MIN_LOG_LEVEL="3", **env)
        for key in ("BACKEND", "VOCAB_SHARDS", "RUNTIME_VERSION"):
            if key not in env:
                full_env.pop(key, None)
        proc = subprocess.run(["bash", str(SCRIPTS / name), *args], capture_output=True,
                              text=True, env=full_env, timeout=timeout, cwd=str(tmp_path))
        return proc, log.read_text().split("\0")[:-1]  # one entry a call

    return run


TINY = ["--dataset_options=vocab_size=40,num_train_tokens=3000,num_valid_tokens=400,"
        "num_test_tokens=401", "--embedding_dim=8", "--hidden_size=8", "--num_layers=1",
        "--batch_size=4", "--bptt=6", "--epochs=1", "--steps_per_epoch=5",
        "--num_diagnostic_contexts=10"]


def test_jax_route_trains_vocabulary_parallel(run_script, tmp_path):
    pytest.importorskip("jax")
    workdir = tmp_path / "run"
    proc, calls = run_script(
        "run_training.sh", *TINY, timeout=300, BACKEND="jax", VOCAB_SHARDS="2",
        GCLOUD_RUN_SSH="1", REMOTE_DIR=str(REPO), REMOTE_MODEL_DIR=str(workdir),
        STEPS_PER_EXECUTION="5", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    (ssh,) = [c for c in calls if " ssh " in f" {c} "]
    assert "KERAS_BACKEND=jax python3 examples/train_lm.py --strategy=model_parallel " \
           "--vocab_shards=2" in ssh, ssh
    assert "--steps_per_execution=5" in ssh and "--tpu" not in ssh, ssh
    results = json.loads((workdir / "results.json").read_text())
    assert results["model"]["backend"] == "jax"
    assert results["model"]["vocab_shards"] == 2 and results["model"]["data_parallel_devices"] == 2
    assert 1.0 < results["test"]["perplexity"] < 60.0 and not results["test"]["partial"]
    assert (workdir / "train.log").exists()
    # Without VOCAB_SHARDS: data-parallel over the cores.
    proc, calls = run_script("run_training.sh", "--epochs=1", BACKEND="jax")
    assert proc.returncode == 0, proc.stderr
    assert "--strategy=data_parallel --steps_per_execution=50" in " ".join(calls[-1].split())


def test_tensorflow_route_is_the_default(run_script):
    proc, calls = run_script("run_training.sh", "--preset=zaremba_small")
    assert proc.returncode == 0, proc.stderr
    ssh = " ".join(calls[-1].split())
    assert "python3 examples/train_lm.py --strategy=tpu --tpu=local " \
           "--steps_per_execution=50" in ssh, ssh
    assert "KERAS_BACKEND" not in ssh and ssh.endswith(
        "--preset=zaremba_small 2>&1 | tee -a ~/runs/train_lm/train.log"), ssh
    proc, calls = run_script("create_vm.sh")
    assert "--version=tpu-vm-tf-2.18.0-pjrt" in calls[1], calls
    proc, calls = run_script("install.sh")
    assert proc.returncode == 0, proc.stderr
    install = calls[-1]
    assert "tensorflow-tpu==2.21.*" in install and "--no-deps -e" in install, install
    assert "jax[tpu]" not in install


def test_jax_install_and_runtime(run_script):
    proc, calls = run_script("create_vm.sh", BACKEND="jax")
    assert proc.returncode == 0 and "--version=tpu-ubuntu2204-base" in calls[1], calls
    proc, calls = run_script("install.sh", BACKEND="jax", JAX_VERSION="0.10.2")
    assert proc.returncode == 0, proc.stderr
    install = calls[-1]
    assert "'jax[tpu]==0.10.2'" in install and "libtpu_releases.html" in install, install
    assert "tensorflow-tpu" not in install and "--no-deps" not in install, install
    assert "KERAS_BACKEND=jax python3 -c" in install, install
    # The repository went over first (an archive of the tracked files).
    assert any(c.startswith("compute tpus tpu-vm scp ") for c in calls), calls


def test_bad_settings_are_refused(run_script):
    proc, calls = run_script("run_training.sh", BACKEND="torch")
    assert proc.returncode == 2 and calls == ["config get-value project"], calls
    assert "BACKEND must be tensorflow or jax. Received: BACKEND=torch" in proc.stderr
    proc, calls = run_script("run_training.sh", VOCAB_SHARDS="4")
    assert proc.returncode == 2 and calls == ["config get-value project"], calls
    assert "VOCAB_SHARDS needs BACKEND=jax" in proc.stderr
    assert "BACKEND=tensorflow VOCAB_SHARDS=4" in proc.stderr
