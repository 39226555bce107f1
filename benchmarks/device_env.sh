# Sourced by the benchmarks/device_*.sh scripts on a GPU machine with JAX and
# no TensorFlow: installs Keras and its two missing dependencies from the
# wheels carried in .whl/ and sets the environment (JAX backend, no GPU
# memory preallocation), then prints the devices and versions.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD KERAS_BACKEND=jax XLA_PYTHON_CLIENT_PREALLOCATE=false \
    PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
nvidia-smi -L
python3 -c "import jax, keras; print(jax.devices(), jax.__version__, keras.__version__)" || exit 1
