"""Shared pytest configuration for keras-softmax-heads."""

import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# The suite's programs are tiny: XLA's CPU compiler spends its time compiling
# them, not running them. Two settings of the CPU compiler's code generation,
# neither of which changes the HLO passes (`memory_analysis` stays within a
# few kilobytes): LLVM at -O0 (`--xla_backend_optimization_level=0`) and the loop
# emitters instead of the MLIR fusion emitters
# (`--xla_cpu_use_fusion_emitters=false`, half the time of a small compile).
# Together they take about half the JAX run's time and a tenth of
# TensorFlow's (mostly tracing). A setting already in XLA_FLAGS wins.
_TEST_XLA_FLAGS = {
    "xla_backend_optimization_level": "0",
    "xla_cpu_use_fusion_emitters": "false",
}
for _flag, _value in _TEST_XLA_FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --{_flag}={_value}"
        ).strip()

import pytest  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _shared_data_dir():
    env = os.environ.get("KSH_SHARED_DATA")
    if env:
        return pathlib.Path(env)
    return REPO_ROOT.parent / "shared" / "data"


@pytest.fixture
def shared_data_dir():
    """`../shared/data` (or $KSH_SHARED_DATA); skips the test when absent."""
    path = _shared_data_dir()
    if not path.is_dir():
        pytest.skip(f"shared data not found at {path}")
    return path


def pytest_configure(config):
    import keras

    if keras.backend.backend() == "torch":
        import torch

        # One intra-op thread per test process: with two xdist workers on
        # two cores, torch's own pool oversubscribes the CPU and its
        # spin-waits stall small kernels by orders of magnitude.
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reset_keras_state():
    import keras

    keras.config.set_dtype_policy("float32")
    # No gc.collect() per test (Keras' default): it costs most of a
    # small test, and names are what isolation needs.
    keras.utils.clear_session(free_memory=False)
    yield
    keras.config.set_dtype_policy("float32")


def pytest_generate_tests(metafunc):
    """Parametrises `case` over the `cases` of a `battery.HeadBattery` class."""
    if "case" in metafunc.fixturenames and metafunc.cls is not None:
        metafunc.parametrize("case", sorted(getattr(metafunc.cls, "cases", {})))


#: Battery tests that train models, and the invalid-input checks (shared
#: `SoftmaxHead` validation; an XLA compilation per case for the NaN of an
#: out-of-range target): on TensorFlow the default run takes them on each
#: battery's first case (every other battery test runs every case).
HEAVY_BATTERY_TESTS = (
    "test_fit_reduces_loss", "test_sequential_head_loss",
    "test_mixed_float16_fit", "test_jit_compile_fit_step", "test_bad_inputs",
)

#: Battery tests under `-m slow` on a backend, by default on the others
#: (each battery's first case), so that the three runs fit their budget:
#: * `test_sequential_head_loss` (`HeadLoss` in a `Sequential`, its exact
#:   evaluation, `.keras` resume): by default on PyTorch (0.3 s a battery).
#:   On JAX (3-7 s a battery: each model's train, test and predict steps
#:   compiled) and TensorFlow (2-12 s) `test_fit_reduces_loss` still trains
#:   each battery's first case through `HeadLoss` where the head has its own
#:   objective, `test_keras_save_load` checks the saved outputs, and
#:   `tests/test_readme.py` runs the README's `Sequential` + `HeadLoss`.
#: * `test_mixed_float16_fit` on TensorFlow (2-9 s a battery, tracing a
#:   float16 graph) and JAX (1-2 s): Keras' loss scaling is the same code on
#:   every backend (by default on PyTorch); `test_mixed_precision` checks the
#:   float16 numerics everywhere.
SLOW_BATTERY_TESTS = {
    "tensorflow": ("test_sequential_head_loss", "test_mixed_float16_fit"),
    "jax": ("test_sequential_head_loss", "test_mixed_float16_fit"),
    "torch": (),
}


#: Test modules of heads written in `keras.ops` alone, no JAX-specific path
#: (no `chunked` core, no dispatch): on JAX their battery and the tests whose
#: name holds one of `JAX_KEEPS` (NumPy references, gradients, compiled or
#: seeded paths, invalid targets under `jit`) run by default, the others under
#: `-m slow`; they run by default on TensorFlow and PyTorch. JAX compiles
#: each new eager operation (20-40 ms each here), so these properties cost
#: 1-5 s a test there.
JAX_SLOW_MODULES = ("test_adaptive", "test_hierarchical", "test_sampled", "test_nce",
                    "test_self_normalized", "test_monotonic", "test_sigsoftmax")
JAX_KEEPS = ("numpy_reference", "gradient", "finite_difference", "seeded", "xla", "jit",
             "bad_targets")


def _first_case_only(items, names):
    for item in items:
        cases = getattr(getattr(item, "cls", None), "cases", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (cases and item.originalname in names and "case" in params
                and params["case"] != sorted(cases)[0]):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """On JAX and PyTorch, runs only the tests marked `multibackend`.

    The suite runs on TensorFlow (the default backend), the battery's
    training tests (`HEAVY_BATTERY_TESTS`) on each battery's first case (the
    other cases under `-m slow`). A test module whose tests hold on every
    backend sets `pytestmark = pytest.mark.multibackend`; under
    `KERAS_BACKEND=jax` or `torch` the other tests (tf.data pipelines,
    tf.distribute, the training script's TensorFlow-only parts) are
    deselected, not skipped one by one. There, a parametrised test runs its
    first parametrisation by default (a battery its first case) and the
    others are marked `slow` (`-m "slow or not slow"` runs them all), as
    are, on PyTorch, the battery's `torch.compile` fit steps
    (`test_jit_compile_fit_step` of a jit-compatible head: 45-80 s each,
    nearly all of it TorchDynamo tracing Keras' train step). On every
    backend `SLOW_BATTERY_TESTS` and a battery's own `slow_tests` are marked
    `slow`, on JAX the other tests of `JAX_SLOW_MODULES`. All so that the three
    backends fit the default run's time budget. Runs first, so that `-m`
    sees the added marks.
    """
    import keras

    backend = keras.backend.backend()
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and (item.originalname in SLOW_BATTERY_TESTS[backend]
                                or item.originalname in getattr(cls, "slow_tests", ())):
            item.add_marker(pytest.mark.slow)
    if backend == "tensorflow":
        _first_case_only(items, HEAVY_BATTERY_TESTS)
        return
    keep, drop = [], []
    for item in items:
        (keep if item.get_closest_marker("multibackend") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    torch = backend == "torch"
    seen = set()
    for item in items:
        cls = getattr(item, "cls", None)
        if (backend == "jax" and cls is None
                and item.module.__name__ in JAX_SLOW_MODULES
                and not any(k in item.originalname for k in JAX_KEEPS)):
            item.add_marker(pytest.mark.slow)
        function = (item.module.__name__, getattr(cls, "__name__", None), item.originalname)
        if hasattr(item, "callspec"):
            if function in seen:
                item.add_marker(pytest.mark.slow)
            seen.add(function)
        # `jit_compile=True` is torch.compile on PyTorch: under `-m slow`
        # (the fall-back fit of a head that cannot compile stays).
        if (torch and item.originalname == "test_jit_compile_fit_step"
                and getattr(cls, "jit_compatible", True)):
            item.add_marker(pytest.mark.slow)
    if torch:
        # With `-m slow`, the torch.compile fit steps (about a minute each)
        # first: xdist then runs the rest on the other worker instead of
        # waiting for them last.
        items.sort(key=lambda item: item.originalname != "test_jit_compile_fit_step")
