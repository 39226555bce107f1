"""Exact evaluation of a split (`Evaluator`) and the papers' diagnostics
(`compute_diagnostics`)."""

from __future__ import annotations

import contextlib
import math

import keras
import numpy as np

from keras_softmax_heads import diagnostics as ksh_diagnostics
from keras_softmax_heads import platforms
from keras_softmax_heads.training.builder import build_model
from keras_softmax_heads.training.inputs import eval_windows


class Scorer(keras.Model):
    """`{"tokens", "targets"}` -> exact `log p(target)` (and optionally h).

    Wraps a backbone and head (shared, not copied) for `predict`: the
    backbone runs with `training=False`; with `return_contexts=True` the
    output is `(log_likelihood, h)` with `h` cast to float32.
    """

    def __init__(self, backbone, head, return_contexts=False, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone
        self.head = head
        self.return_contexts = return_contexts
        self.built = True

    def call(self, inputs, training=False):
        h = self.backbone(inputs["tokens"], training=False)
        ll = self.head.log_likelihood(h, inputs["targets"])
        if self.return_contexts:
            return ll, keras.ops.cast(h, "float32")
        return ll


class _WaitForEachStep(keras.callbacks.Callback):
    """Makes `predict` wait for each step's outputs before it dispatches the
    next one (see `_step_by_step`)."""

    def on_predict_batch_end(self, batch, logs=None):
        keras.tree.map_structure(np.asarray, logs)


def _step_by_step():
    """`predict`'s callbacks for the evaluation on several devices.

    On JAX's CPU devices (`--xla_force_host_platform_device_count`, the
    model-parallel tests) a `predict` that dispatches step after step
    without waiting can deadlock. XLA's CPU client runs the devices'
    programs and their launches on one pool of `max(cores, devices)`
    workers; a launch waits, on its worker, while its device has 32
    computations in flight. On 2 cores with 4 devices, `gdb` showed two
    workers inside an all-reduce of one step and the other two in later
    steps' launches (`Semaphore::ScopedAcquire`), so the all-reduce's
    partners had no worker left to run on; the run ended in XLA's 40 s
    rendezvous timeout. The evaluation's stateful windows chain every
    step to the one before, so waiting for each step costs little there.
    Elsewhere (one device, accelerators) `predict` runs ahead as Keras
    does by default."""
    if keras.backend.backend() != "jax" or platforms.current_platform() != "cpu":
        return None
    import jax

    return [_WaitForEachStep()] if jax.local_device_count() > 1 else None


class Evaluator:
    """Scores the splits of `corpus` exactly with the weights of `model`.

    Evaluation runs on the training replicas, except for multi-worker runs,
    where each worker evaluates a local copy (`predict` gathers local
    replicas only). The evaluation batch (`config.eval_batch_size`, default
    `config.batch_size`) is rounded up to a multiple of the replicas. When
    the training model cannot be used as is (another strategy, or a stateful
    LSTM with another batch size), an evaluation copy is built and given
    the training weights before every evaluation.

    With `strategy=None` (no TensorFlow: `train_and_evaluate_arrays`) the
    windows are fed to `predict` as NumPy arrays on the current device.

    Call under no strategy scope; builds its models in the right one.
    """

    def __init__(self, config, corpus, model, strategy):
        self.config = config
        self.corpus = corpus
        self.model = model
        if strategy is None:
            self.strategy = None
        else:
            import tensorflow as tf

            multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            self.strategy = tf.distribute.get_strategy() if multi_worker else strategy
        replicas = self.strategy.num_replicas_in_sync if self.strategy is not None else 1
        batch = config.eval_batch_size or config.batch_size
        if batch % replicas:
            batch = -(-batch // replicas) * replicas
        self.batch_size = batch
        stateful = config.model == "lstm"
        if self.strategy is strategy and (not stateful or batch == config.batch_size):
            self.eval_model = model
        else:
            with self._scope():
                self.eval_model, _ = build_model(config, corpus, batch, compile=False,
                                                 num_replicas=replicas)
        with self._scope():
            self._scorer = Scorer(self.eval_model.backbone, self.eval_model.head, name="scorer")
            self._scorer.compile(jit_compile=config.jit_compile)
            self._context_scorer = Scorer(self.eval_model.backbone, self.eval_model.head,
                                          return_contexts=True, name="context_scorer")
            self._context_scorer.compile(jit_compile=config.jit_compile)

    def _scope(self):
        return self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()

    @property
    def head(self):
        """The head that scores (shares the training model's weights)."""
        return self.eval_model.head

    def evaluate(self, ids, max_windows=None, with_contexts=0, previous=None):
        """Exact per-target log-likelihoods of split `ids`, in stream order.

        Args:
            ids: the split's token ids; every token but the first is a target.
            max_windows: optional cap on the evaluation windows that score
                targets (warm-up windows before them are read too; the
                result is then `partial`).
            with_contexts: also return the context vectors of
                `with_contexts` targets: those of the first windows, in
                stream order.

        Returns:
            A dict: `ll` (float64 `[N]`), `targets` (`[N]`), `partial`
            (bool) and with contexts `contexts` (`[C, d]`) and
            `context_inputs` (the last input token of each, `[C]`).
        """
        config = self.config
        if self.eval_model is not self.model:
            self.eval_model.set_weights(self.model.get_weights())
        tokens, targets, position = eval_windows(config, self.corpus, ids, self.batch_size,
                                                 previous=previous)
        windows = len(tokens)
        if max_windows:
            # Count the windows that score targets: the warm-up windows
            # before the first of them are read, not counted.
            scoring = np.flatnonzero((position >= 0).reshape(len(tokens), -1).any(axis=1))
            first = int(scoring[0]) if len(scoring) else 0
            windows = min(first + max_windows, len(tokens))
        partial = windows < len(tokens)
        tokens, targets, position = tokens[:windows], targets[:windows], position[:windows]
        valid = position >= 0
        order = np.argsort(position[valid], kind="stable")
        ll = np.asarray(self._predict(self._scorer, tokens, targets, windows))
        ll = ll.reshape(position.shape)
        out = {
            "ll": ll[valid][order].astype(np.float64),
            "targets": targets[valid][order],
            "partial": partial,
        }
        if with_contexts:
            # The fewest windows holding `with_contexts` targets (warm-up
            # positions hold none).
            per_window = valid.reshape(windows, -1).sum(axis=1)
            count = min(windows, int(np.searchsorted(np.cumsum(per_window), with_contexts)) + 1)
            _, h = self._predict(self._context_scorer, tokens, targets, count)
            h = np.asarray(h).reshape(position[:count].shape + (-1,))
            sub_valid = valid[:count]
            sub_order = np.argsort(position[:count][sub_valid], kind="stable")
            last_input = tokens[:count] if config.model == "lstm" else tokens[:count][..., -1]
            out["contexts"] = h[sub_valid][sub_order][:with_contexts]
            out["context_inputs"] = last_input[sub_valid][sub_order][:with_contexts]
        return out

    def _predict(self, scorer, tokens, targets, count):
        """`scorer` over the first `count` windows, from a zero LSTM state."""
        self.eval_model.backbone.reset_states()
        sub = {"tokens": tokens[:count], "targets": targets[:count]}
        if self.strategy is None:
            # One window per batch, in order (the LSTM state carries over).
            flat = {k: v.reshape((-1,) + v.shape[2:]) for k, v in sub.items()}
            return scorer.predict(flat, batch_size=self.batch_size, verbose=0)
        import tensorflow as tf

        from keras_softmax_heads.data.batching import without_autotune
        from keras_softmax_heads.training.distribute import distribute_dataset

        # Without autotuning: with it, predict's iterator waits seconds for
        # the autotuning thread at the end of every evaluation on one core.
        dataset = distribute_dataset(
            self.strategy, lambda: without_autotune(tf.data.Dataset.from_tensor_slices(sub)))
        return scorer.predict(dataset, steps=count, verbose=0, callbacks=_step_by_step())

    @staticmethod
    def summarise(result):
        """`nll` (nats per token), `perplexity`, `bits_per_token`, `tokens`
        and `partial` of an `evaluate` result."""
        nll = float(-np.mean(result["ll"]))
        return {"nll": nll, "perplexity": float(np.exp(nll)),
                "bits_per_token": nll / math.log(2.0),
                "tokens": int(result["ll"].size), "partial": bool(result["partial"])}

    def score(self, ids, max_windows=None, previous=None):
        """`summarise(evaluate(ids, max_windows, previous=previous))`."""
        return self.summarise(self.evaluate(ids, max_windows, previous=previous))


def band_edges(vocab_size, band_fractions):
    """Frequency-rank band edges: `round(f * V)` clipped to `[1, V - 1]`,
    sorted, duplicates dropped."""
    return sorted({max(1, min(vocab_size - 1, int(round(f * vocab_size))))
                   for f in band_fractions})


def compute_diagnostics(config, corpus, head, test_result, test_summary):
    """The papers' diagnostics of the test split.

    Args:
        config: the run's `TrainConfig` (`band_fractions`).
        corpus: the `LMCorpus` (word counts; `true_model` and `info` of the
            synthetic corpus).
        head: the trained head.
        test_result: `Evaluator.evaluate(test, with_contexts=C)`.
        test_summary: `Evaluator.summarise(test_result)`.

    Returns:
        A dict: `entropy_per_frequency_band` and `band_edges` (Chen et al.
        2016), `empirical_rank` of the `[C, V]` log-probability matrix
        (Kanai et al. 2018; a linear softmax has rank at most `d + 2`),
        and, for a corpus with a known `true_model`, `synthetic`: KL to the
        truth, mode matching (Ganea et al. 2019) and the gaps of the test
        cross-entropy to the entropy rate and to the floor of this test
        sample.
    """
    vocab_size = corpus.vocab_size
    edges = band_edges(vocab_size, config.band_fractions)
    diagnostics = {
        "entropy_per_frequency_band": ksh_diagnostics.entropy_per_frequency_band(
            test_result["ll"], test_result["targets"], np.asarray(corpus.vocab.counts), edges),
        "band_edges": edges,
    }
    contexts = test_result["contexts"]
    log_q = ksh_diagnostics.log_prob_matrix(head, contexts.astype("float32"))
    diagnostics["empirical_rank"] = {
        "rank": ksh_diagnostics.empirical_rank(log_q),
        "num_contexts": int(len(contexts)),
        "vocab_size": vocab_size,
        "context_dim": int(contexts.shape[-1]),
        "linear_softmax_bound": int(contexts.shape[-1]) + 2,
    }
    true_model = getattr(corpus, "true_model", None)
    if true_model is None:
        return diagnostics
    true_probs = true_model.next_word_probs(test_result["context_inputs"])
    floor = corpus.info.get("test_cross_entropy") if getattr(corpus, "info", None) else None
    nll = test_summary["nll"]
    synthetic = {
        "kl_to_truth": ksh_diagnostics.kl_divergence(true_probs, log_q),
        "mode_matching": ksh_diagnostics.mode_matching(true_probs, log_q),
        "num_contexts": int(len(contexts)),
        "true_entropy_rate": float(true_model.entropy_rate),
        "test_cross_entropy": nll,
        "gap_to_entropy_rate": nll - float(true_model.entropy_rate),
    }
    if floor is not None:
        synthetic["test_floor"] = float(floor)
        synthetic["gap_to_floor"] = nll - float(floor)
        synthetic["floor_perplexity"] = float(np.exp(floor))
    diagnostics["synthetic"] = synthetic
    return diagnostics
