"""The shared test battery that every head of the library runs.

Usage, in a head's test module::

    from battery import HeadBattery

    class TestPLIFBattery(HeadBattery):
        cases = {
            "default": lambda vocab, dim: ksh.PLIFSoftmax(vocab, num_knots=50),
        }

Each case is a factory `(vocab_size, input_dim) -> fresh head`. The battery
checks: shapes and normalisation, `log_likelihood`/`training_loss` shapes and
consistency, a directional finite-difference gradient check in float64,
`get_config` round trip, `.keras` save/load, `jit_compile=True`,
`mixed_float16` / `mixed_bfloat16`, that `fit` lowers the loss (compiled with
XLA where the head compiles), `HeadLoss` in a `Sequential`, extreme inputs,
and clear errors for bad inputs.

Class attributes a subclass may set:
    cases: dict name -> factory.
    exact_training_loss: `training_loss == -log_likelihood` (exact heads).
    sequential_fit: the head also trains as the last layer of a
        `keras.Sequential` with `SparseCategoricalCrossentropy(from_logits=True)`.
    vocab_size, input_dim: tiny sizes.
    grad_rtol: tolerance of the float64 finite-difference check.
    fit_epochs: epochs of the "loss goes down" test.
    extreme_scale: |logit| scale reached by the extreme-input test.
    slow_tests: names of battery tests this battery runs under `-m slow`
        only (conftest marks them; a mark on an override would change the
        shared battery for every subclass).
    jit_compatible: the head compiles with XLA. False for a head with
        data-dependent shapes by design (`supports_jit = False`): Keras must
        then fall back from `jit_compile=True` to graph mode.
"""

import os
import tempfile

import keras
import numpy as np
import pytest
import keras_softmax_heads as ksh
from backends import BACKEND
from backends import build_optimizer
from backends import is_target_error
from backends import jit
from backends import to_numpy
from backends import value_and_grad


#: (step, tolerance) of the float32 finite-difference check (JAX, PyTorch).
FLOAT32_FD = (1e-3, 2e-2)


class HeadBattery:
    cases = {}
    exact_training_loss = True
    sequential_fit = True
    vocab_size = 13
    input_dim = 6
    grad_rtol = 1e-5
    fit_epochs = 30
    extreme_scale = 1e4
    jit_compatible = True
    slow_tests = ()

    # ------------------------------------------------------------ utilities
    def make(self, case, **overrides):
        return self.cases[case](self.vocab_size, self.input_dim, **overrides)

    def inputs(self, shape=(3, 4), seed=0, dtype="float32"):
        rng = np.random.default_rng(seed)
        return rng.normal(size=shape + (self.input_dim,)).astype(dtype)

    def targets(self, shape=(3, 4), seed=1):
        rng = np.random.default_rng(seed)
        return rng.integers(0, self.vocab_size, size=shape).astype("int32")

    def built(self, case, seed=0, **overrides):
        """A head built and with all weights randomised (not the init)."""
        keras.utils.set_random_seed(seed)
        head = self.make(case, **overrides)
        head(self.inputs())
        rng = np.random.default_rng(seed + 100)
        for w in head.weights:
            if "int" in str(w.dtype) or not w.trainable:
                continue
            value = w.numpy()
            w.assign((value + 0.3 * rng.normal(size=value.shape)).astype(value.dtype))
        return head

    # ------------------------------------------------------------ the tests
    def test_shapes_and_normalisation(self, case):
        head = self.built(case)
        for shape in [(5,), (3, 4)]:
            log_p = to_numpy(head(self.inputs(shape)))
            assert log_p.shape == shape + (self.vocab_size,)
            assert log_p.dtype == np.float32
            assert np.all(np.isfinite(log_p))
            lse = np.log(np.exp(log_p.astype("float64")).sum(-1))
            np.testing.assert_allclose(lse, 0.0, atol=1e-5)
            np.testing.assert_allclose(
                to_numpy(head.log_probs(self.inputs(shape))), log_p, atol=1e-6
            )

    def test_log_likelihood_and_training_loss(self, case):
        head = self.built(case)
        h, t = self.inputs(), self.targets()
        log_p = to_numpy(head(h))
        ll = to_numpy(head.log_likelihood(h, t))
        assert ll.shape == t.shape
        expected = np.take_along_axis(log_p, t[..., None], -1)[..., 0]
        np.testing.assert_allclose(ll, expected, atol=1e-5)
        loss = to_numpy(head.training_loss(h, t, training=True))
        assert loss.shape == t.shape
        assert np.all(np.isfinite(loss))
        if self.exact_training_loss:
            np.testing.assert_allclose(loss, -ll, atol=1e-5)

    @pytest.mark.skipif(BACKEND != "tensorflow", reason="a batch size unknown at trace "
                        "time is a TensorFlow graph's (Keras fit / evaluate on tf.data)")
    def test_log_likelihood_with_unknown_batch_size(self, case):
        """`log_likelihood` traced with a `None` batch (what Keras' `fit`
        and `evaluate` trace on `tf.data` or a partial last batch) gives
        each token its own target's value, as eagerly (`AdaptiveSoftmax`
        once read another token's there)."""
        import tensorflow as tf

        head = self.built(case)
        h = self.inputs((12,), seed=3)
        t = self.targets((12,), seed=4)
        graph = tf.function(head.log_likelihood, autograph=False, input_signature=[
            tf.TensorSpec([None, self.input_dim]), tf.TensorSpec([None], tf.int32)])
        np.testing.assert_allclose(to_numpy(graph(h, t)), to_numpy(head.log_likelihood(h, t)),
                                   atol=1e-5)

    def test_gradients_finite_difference(self, case):
        """Directional derivatives of the loss vs central differences.

        In float64 on TensorFlow. On JAX and PyTorch Keras computes float64
        ops in float32 (JAX's default type promotion), so the check runs in
        float32 there, with a larger step and tolerance (`FLOAT32_FD`).
        """
        dtype, eps, tol = ("float64", 1e-6, self.grad_rtol)
        if BACKEND != "tensorflow":
            dtype, eps, tol = "float32", *FLOAT32_FD
        keras.config.set_dtype_policy(dtype)
        head = self.built(case)
        h = self.inputs(dtype=dtype)
        t = self.targets()
        weights = keras.ops.convert_to_tensor(
            np.random.default_rng(3).normal(size=t.shape), dtype
        )

        def objective(x):
            ll = head.log_likelihood(x, t)
            return keras.ops.sum(keras.ops.cast(ll, dtype) * weights)

        variables = [w for w in head.trainable_weights]
        assert_directional_gradients(
            objective, h, variables, np.random.default_rng(4),
            eps=eps, rtol=tol, atol=tol,
        )

    def test_config_round_trip(self, case):
        head = self.built(case)
        config = head.get_config()
        clone = head.__class__.from_config(config)
        assert clone.get_config() == config
        h = self.inputs()
        clone(h)
        clone.set_weights(head.get_weights())
        np.testing.assert_array_equal(to_numpy(clone(h)), to_numpy(head(h)))

    def test_keras_save_load(self, case):
        head = self.built(case)
        inputs = keras.Input((4, self.input_dim))
        model = keras.Model(inputs, head(inputs))
        h = self.inputs()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "head.keras")
            model.save(path)
            loaded = keras.models.load_model(path)
        np.testing.assert_array_equal(
            loaded.predict(h, verbose=0), model.predict(h, verbose=0)
        )

    def _head_model(self, head):
        backbone = keras.Sequential(
            [keras.layers.Embedding(self.vocab_size, self.input_dim)]
        )
        return ksh.HeadModel(backbone, head)

    def _fit_passes(self, model, x, y):
        """`fit_epochs` passes over (x, y) in batches of 8, as one epoch of
        the data repeated: the same optimizer steps without Keras' per-epoch
        overhead (about half the time of a small fit on TensorFlow)."""
        repeats = (self.fit_epochs,) + (1,) * (np.ndim(x) - 1)
        if model.built:
            build_optimizer(model)  # one trace of the step on TensorFlow
        model.fit(np.tile(x, repeats), np.tile(y, repeats), batch_size=8,
                  epochs=1, verbose=0)

    def _tokens(self, n=16, length=6, seed=0):
        rng = np.random.default_rng(seed)
        x = rng.integers(0, self.vocab_size, size=(n, length)).astype("int32")
        return x, np.roll(x, -1, axis=1)

    def _compiles(self):
        """`jit_compile=True` compiles this head's training step with XLA:
        a jit-compatible head on TensorFlow or JAX (on PyTorch it would be
        `torch.compile`)."""
        return self.jit_compatible and BACKEND != "torch"

    def test_jit_compile_fit_step(self, case):
        """`compile(jit_compile=True)`: a head that cannot compile falls back
        with a warning and trains; on PyTorch (`torch.compile`) the step
        trains. A jit-compatible head's XLA fit and evaluation on TensorFlow
        and JAX are `test_fit_reduces_loss`'s (it compiles with
        `jit_compile=True`): here only the setting is checked."""
        keras.utils.set_random_seed(0)
        model = self._head_model(self.make(case))
        if self.jit_compatible:
            model.compile(optimizer="adam", jit_compile=True)
            assert model.jit_compile
            if self._compiles():
                return
        else:
            with pytest.warns(UserWarning, match="jit_compile"):
                model.compile(optimizer="adam", jit_compile=True)
            assert not model.jit_compile
        x, y = self._tokens()
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][-1])
        logs = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
        assert np.isfinite(logs["loss"])

    @pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
    def test_mixed_precision(self, case, policy):
        """float32 log-probabilities and log-likelihoods from a float16 or
        bfloat16 compute type (the fits: `test_mixed_float16_fit`,
        `test_mixed_bfloat16_fit`)."""
        keras.config.set_dtype_policy(policy)
        keras.utils.set_random_seed(0)
        head = self.make(case)
        h = self.inputs()
        log_p = to_numpy(head(h))
        assert log_p.dtype == np.float32, "log-probs must be accumulated in float32"
        assert np.all(np.isfinite(log_p))
        lse = np.log(np.exp(log_p.astype("float64")).sum(-1))
        np.testing.assert_allclose(lse, 0.0, atol=1e-4)
        ll = to_numpy(head.log_likelihood(h, self.targets()))
        assert ll.dtype == np.float32 and np.all(np.isfinite(ll))

    def test_mixed_float16_fit(self, case):
        """A `fit` under `mixed_float16` (Keras' loss scaling) stays finite."""
        keras.config.set_dtype_policy("mixed_float16")
        keras.utils.set_random_seed(0)
        self._fit_stays_finite(self.make(case))

    @pytest.mark.slow
    def test_mixed_bfloat16_fit(self, case):
        keras.config.set_dtype_policy("mixed_bfloat16")
        keras.utils.set_random_seed(0)
        self._fit_stays_finite(self.make(case))

    def _fit_stays_finite(self, head):
        model = self._head_model(head)
        model.compile(optimizer="adam")
        x, y = self._tokens()
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][-1])

    def test_fit_reduces_loss(self, case):
        keras.utils.set_random_seed(0)
        x, y = self._tokens(n=32, length=6)
        # A learnable deterministic task: predict the next token of a cycle.
        x = (np.arange(6)[None, :] + np.arange(32)[:, None]) % self.vocab_size
        y = (x + 1) % self.vocab_size
        model = self._head_model(self.make(case))
        # XLA where the head compiles (TensorFlow, JAX): the compiled fit
        # and evaluation `test_jit_compile_fit_step` leaves to this test.
        model.compile(optimizer=keras.optimizers.Adam(0.05),
                      jit_compile=True if self._compiles() else "auto")
        assert model.jit_compile == self._compiles()
        before = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
        self._fit_passes(model, x, y)
        after = model.evaluate(x, y, verbose=0, return_dict=True)["loss"]
        assert after < 0.7 * before, (before, after)
        if self.sequential_fit and type(self.make(case)).exact_training_objective:
            keras.utils.set_random_seed(0)
            seq = keras.Sequential(
                [
                    keras.Input((6,), dtype="int32"),
                    keras.layers.Embedding(self.vocab_size, self.input_dim),
                    self.make(case),
                ]
            )
            seq.compile(
                keras.optimizers.Adam(0.05),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["sparse_categorical_accuracy"],
            )
            first = seq.evaluate(x, y, verbose=0)[0]
            self._fit_passes(seq, x, y)
            last = seq.evaluate(x, y, verbose=0)[0]
            assert last < 0.7 * first, (first, last)
        # As the README shows: a Sequential trained with HeadLoss (heads with
        # their own objective or a cheaper exact loss; for the others it is
        # the exact NLL above, and test_sequential_head_loss checks the path).
        keras.utils.set_random_seed(0)
        head = self.make(case)
        if type(head).exact_training_objective and not self.avoids_full_scores_in_training:
            return
        seq = self._sequential(head)
        # Keras' default `jit_compile`: XLA on JAX, graph mode on a CPU-only
        # TensorFlow (the HeadModel above compiled with XLA there), eager on
        # PyTorch (`torch.compile` is `test_jit_compile_fit_step`'s).
        seq.compile(keras.optimizers.Adam(0.05), loss=ksh.HeadLoss(head))
        first = seq.evaluate(x, y, verbose=0)
        self._fit_passes(seq, x, y)
        last = seq.evaluate(x, y, verbose=0)
        assert last < 0.7 * first, (first, last)

    def _sequential(self, head, length=6):
        return keras.Sequential([
            keras.Input((length,), dtype="int32"),
            keras.layers.Embedding(self.vocab_size, self.input_dim),
            head,
        ])

    #: Heads whose training loss never needs the [..., V] log-probabilities.
    avoids_full_scores_in_training = False

    def test_sequential_head_loss(self, case, tmp_path, monkeypatch):
        """A Sequential with HeadLoss trains the head's own objective, never a
        silent full softmax; evaluation is exact; .keras round trip resumes."""
        keras.utils.set_random_seed(0)
        head = self.make(case)
        seq = self._sequential(head)
        x, y = self._tokens(n=16, length=6)
        seq.compile("adam", loss=ksh.HeadLoss(head), metrics=[ksh.Perplexity()])
        contexts = seq(x, training=True)
        assert tuple(contexts.shape) == (16, 6, 1, self.input_dim)
        build_optimizer(seq)
        if self.avoids_full_scores_in_training:
            # Keras builds the model and its metrics first (on JAX with a
            # symbolic inference call, which may use the full scores).
            seq.evaluate(x, y, batch_size=8, verbose=0)

            def no_full_scores(*args, **kwargs):
                raise AssertionError("log_probs called in a training step")
            monkeypatch.setattr(head, "log_probs", no_full_scores)
            seq.fit(x, y, batch_size=8, epochs=1, verbose=0)
            monkeypatch.undo()
        history = seq.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert np.isfinite(history.history["loss"][-1])
        # Exact evaluation: the exact NLL and its perplexity.
        logs = seq.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
        h = seq.layers[0](x)
        exact = -float(np.mean(to_numpy(head.log_likelihood(h, y))))
        np.testing.assert_allclose(logs["loss"], exact, rtol=1e-5)
        np.testing.assert_allclose(logs["perplexity"], np.exp(exact), rtol=1e-5)
        # Save, load, predict the same, keep the optimizer state, train on.
        path = str(tmp_path / "seq.keras")
        seq.save(path)
        loaded = keras.saving.load_model(path)
        np.testing.assert_allclose(loaded.predict(x, verbose=0), seq.predict(x, verbose=0),
                                   rtol=1e-6, atol=1e-6)
        for a, b in zip(loaded.optimizer.variables, seq.optimizer.variables):
            np.testing.assert_array_equal(to_numpy(a), to_numpy(b))
        loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)
        # The wrong pattern never trains a silent full softmax.
        if not type(head).exact_training_objective:
            wrong = self._sequential(self.make(case))
            wrong.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            with pytest.raises(ValueError, match="HeadLoss"):
                wrong.fit(x, y, batch_size=8, epochs=1, verbose=0)

    def test_extreme_inputs(self, case):
        head = self.built(case)
        h = self.inputs()
        # The logits' linear part (a bias start, e.g. -log V, does not scale).
        linear = to_numpy(head.logits(h)) - to_numpy(head.logits(h * 0.0))
        scale = self.extreme_scale / max(float(np.abs(linear).max()), 1e-6)
        big = h * scale
        assert np.abs(to_numpy(head.logits(big))).max() > 0.5 * self.extreme_scale
        log_p = to_numpy(head(big))
        assert np.all(np.isfinite(log_p)), "non-finite log-probs at |logit|~1e4"
        assert np.all(log_p <= 1e-5)
        ll = to_numpy(head.log_likelihood(big, self.targets()))
        assert np.all(np.isfinite(ll))

    def test_bad_inputs(self, case):
        head = self.built(case)
        wrong = np.zeros((2, self.input_dim + 1), "float32")
        with pytest.raises(ValueError, match=str(self.input_dim)):
            head(wrong)
        with pytest.raises(ValueError):
            head.log_likelihood(wrong, np.zeros((2,), "int32"))
        h = self.inputs((2,))
        for bad_targets in ([0, self.vocab_size], [-1, 0]):
            with pytest.raises(Exception, match="vocab_size") as info:
                head.log_likelihood(h, np.array(bad_targets))
            assert is_target_error(info.value), info.value
        if self.jit_compatible and BACKEND != "torch":
            # Under XLA values are unknown when the check would run: NaN.
            jitted = jit(head.log_likelihood)
            out = to_numpy(jitted(h, np.array([0, self.vocab_size])))
            assert np.isfinite(out[0]) and np.isnan(out[1])

    def test_tied_embedding(self, case):
        emb = keras.layers.Embedding(self.vocab_size, self.input_dim)
        try:
            head = self.cases[case](None, None, token_embedding=emb)
        except TypeError:
            pytest.skip("head does not support tied embeddings")
        tokens = keras.Input((4,), dtype="int32")
        model = keras.Model(tokens, head(emb(tokens)))
        x = self._tokens(n=3, length=4)[0]
        out = model.predict(x, verbose=0)
        assert out.shape == (3, 4, self.vocab_size)
        assert head.kernel is None
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "tied.keras")
            model.save(path)
            loaded = keras.models.load_model(path)
        np.testing.assert_array_equal(loaded.predict(x, verbose=0), out)
        loaded_head = loaded.layers[-1]
        assert loaded_head.token_embedding is loaded.get_layer(emb.name)
        bad = keras.layers.Embedding(self.vocab_size + 1, self.input_dim)
        with pytest.raises(ValueError, match="vocab_size"):
            self.cases[case](self.vocab_size, None, token_embedding=bad)
        wrong_dim = keras.layers.Embedding(self.vocab_size, self.input_dim + 2)
        head = self.cases[case](None, None, token_embedding=wrong_dim)
        with pytest.raises(ValueError, match="output_dim"):
            head(self.inputs())


def assert_directional_gradients(objective, h, variables, rng, eps=1e-6,
                                 rtol=1e-6, atol=1e-7):
    """Checks autodiff gradients against central finite differences.

    `objective(x)` returns a scalar; `h` is a float64 input array and
    `variables` the Keras variables to differentiate with respect to (the
    gradient with respect to `h` is always checked, first). For each, a
    random direction `u ~ N(0, 1)` is drawn from `rng` and the directional
    derivative `<grad, u>` (`backends.value_and_grad`, on any backend) is
    compared with `(objective(. + eps u) - objective(. - eps u)) / (2 eps)`
    (a variable is moved and restored; for `h`, `objective` is called on the
    moved array). Returns the gradients `[grad_h] + variable_grads` as NumPy
    arrays.

    The battery's `test_gradients_finite_difference` and the tests of heads
    with fixed samples / rows use this one checker.
    """
    variables = [v for v in variables if v is not h]  # `h` is always checked
    h = np.asarray(to_numpy(h))
    _, (grad_h,), grad_vars = value_and_grad(objective, [h], variables)
    grads = [grad_h] + list(grad_vars)
    for var, grad in zip([None] + list(variables), grads):
        name = "inputs" if var is None else getattr(var, "path", getattr(var, "name", "?"))
        assert grad is not None, f"no gradient for {name}"
        shape = h.shape if var is None else tuple(var.shape)
        direction = rng.normal(size=shape)
        analytic = float(np.sum(grad * direction))
        if var is None:
            up = float(to_numpy(objective(h + eps * direction)))
            down = float(to_numpy(objective(h - eps * direction)))
        else:
            v0 = var.numpy()
            var.assign(v0 + eps * direction)
            up = float(to_numpy(objective(h)))
            var.assign(v0 - eps * direction)
            down = float(to_numpy(objective(h)))
            var.assign(v0)
        numeric = (up - down) / (2 * eps)
        np.testing.assert_allclose(
            analytic, numeric, rtol=rtol, atol=atol,
            err_msg=f"gradient mismatch for {name}",
        )
    return grads
