"""`train_and_evaluate` under `strategy="model_parallel"` (JAX, 4 simulated
host devices, a subprocess: `XLA_FLAGS` must be set before JAX starts).

`VocabularyParallel(V, vocab_shards=2)` over 4 devices: a 2 x 2 mesh, the
vocabulary-sized weights (the tied `[V, d]` embedding, the head's bias,
their Adam slots: Adam is the default) split on V over `"model"`, everything else replicated,
the batch split over `"batch"`. The run trains and evaluates to the
unsharded run's losses and weights (to float32 rounding: the reductions
are ordered differently), and a run resumed from its checkpoint to the
uninterrupted one's; with `chunk_size`, the summed objective of
`FullSoftmax` (`vocab_parallel_summed`) and of `PLIFSoftmax`
(`vocab_parallel_mixture`; `-m slow`: `SigSoftmax`, MoS) runs on each
device's shard. The other heads train
the same under XLA's partitioning of those layouts (`-m slow`: every
head; and under `mixed_bfloat16`). The evaluation's `predict` waits for
each step on these host devices (a callback: run ahead, it deadlocked XLA's
CPU client now and then). The bad settings are refused with the values
received."""

import json
import sys

import keras
import numpy as np
import pytest
from backends import count_calls
from backends import run_on_simulated_devices

from keras_softmax_heads import training

DEVICES = 4
#: The heads trained with `chunk_size` (their summed objective, with its
#: gradient in the forward pass, runs vocabulary-parallel).
CHUNKED = ("full_softmax", "sigsoftmax", "plif", "mixture_of_softmaxes")
#: The heads whose summed training objective runs on each device's shard:
#: the chunked ones and `MixtureOfContexts` (the summed cross-entropy of its
#: mixed context, whatever its `chunk_size`).
SUMMED_ON_SHARDS = CHUNKED + ("mixture_of_contexts",)
TINY_DATA = dict(vocab_size=40, num_train_tokens=3000, num_valid_tokens=400,
                 num_test_tokens=401)


def _count_summed_calls(module, name, calls):
    """`count_calls` of the summed passes only: `module.name` called
    without `return_per_token=True` (the per-token evaluation on the shards
    goes through the same function)."""
    fn = getattr(module, name)

    def call(*args, **kwargs):
        if not kwargs.get("return_per_token"):
            calls.append(name)
        return fn(*args, **kwargs)

    setattr(module, name, call)


def _config(head, **overrides):
    values = dict(
        dataset_options=TINY_DATA, head=head, embedding_dim=8, hidden_size=8,
        num_layers=1, batch_size=4, bptt=6, epochs=2, steps_per_epoch=5, verbose=0,
        num_diagnostic_contexts=10, tensorboard=False, validate_every_epoch=False,
    )
    values.update(overrides)
    return training.get_config(**values)


def _check(result, rtol=2e-5, weights_rtol=2e-4):
    assert result["model"] == {"data_parallel_devices": 2, "vocab_shards": 2}, result
    for split in ("train_loss", "test_nll"):
        sharded, *others = result[split]
        for other in others:  # the unsharded run, the resumed one
            assert np.allclose(sharded, other, rtol=rtol, atol=0), (split, result)
    # Each trainable weight, relative to its largest entry. (Adam divides
    # by the gradients' scale: where they are tiny, rounding differences
    # move a weight further; 4.4e-5 measured, MonotonicSoftmax's MLP.)
    assert result["weights_rel_err"] < weights_rtol, result
    # The tied embedding and the head's bias (and their Adam slots: Adam is the default) split on
    # V over "model"; the recurrent weights replicated.
    layouts = result["layouts"]
    assert layouts["embeddings"] == ["model", None], layouts
    assert layouts["bias"] in ([], [["model"]]), layouts
    assert layouts["embeddings_slots"] == [["model", None]] * 2, layouts
    assert all(axis is None for axis in layouts["lstm_kernel"]), layouts
    # The summed objective runs on each device's shard (traced once for
    # training; the evaluation is per-token).
    assert (result["vocab_parallel_calls"] > 0) == (result["head"] in SUMMED_ON_SHARDS), result
    # The evaluation's `predict` waited for each step (a callback with
    # `on_predict_batch_end`): run 32 steps ahead on host CPU devices it
    # could deadlock XLA's CPU client (docs/results/simulated_devices_deadlock).
    assert result["predicts_waiting"] == [True] * len(result["predicts_waiting"]), result
    assert result["predicts_waiting"], result


def test_model_parallel_training_matches_single_device():
    result = run_on_simulated_devices(__file__, DEVICES, "full_softmax", "plif")
    full = result["full_softmax"]
    _check(full)
    _check(result["plif"])
    # The resumed run was compared; it trained its second epoch only.
    assert len(full["test_nll"]) == 3 and full["first_epoch_kept"], full


@pytest.mark.slow
def test_every_head_trains_under_model_parallel():
    heads = ["adaptive", "adaptive:chunked", "differentiated", "hierarchical",
             "mixture_of_contexts", "mixture_of_softmaxes", "monotonic", "nce", "plif",
             "sampled_softmax", "self_normalized", "sigsoftmax"]
    result = run_on_simulated_devices(__file__, DEVICES, *heads)
    assert sorted(result) == sorted(heads), result
    for head in heads:
        _check(result[head])


@pytest.mark.slow
def test_model_parallel_training_under_mixed_bfloat16():
    """`--mixed_precision=mixed_bfloat16` with `--strategy=model_parallel`:
    the chunked heads, and the heads with a per-token path on the shards
    (`HierarchicalSoftmax`, MoC, `MonotonicSoftmax`), train and evaluate on
    their shards to the unsharded bfloat16 run's losses (measured: test NLL
    within 1.5e-5 relative, weights within 6.4e-3 of their scale, the
    products in bfloat16)."""
    heads = ["plif:bf16", "full_softmax:bf16", "mixture_of_softmaxes:bf16",
             "hierarchical:bf16", "mixture_of_contexts:bf16", "monotonic:bf16"]
    result = run_on_simulated_devices(__file__, DEVICES, *heads)
    assert sorted(result) == sorted(heads), result
    for name in heads:
        _check(result[name], rtol=1e-4, weights_rtol=2e-2)


def test_bad_model_parallel_settings_are_refused():
    with pytest.raises(ValueError, match="strategy='model_parallel' only.*vocab_shards=2"):
        training.validate_config(_config("full_softmax", vocab_shards=2))
    with pytest.raises(ValueError, match="vocab_shards=0"):
        training.validate_config(_config("full_softmax", strategy="model_parallel",
                                         vocab_shards=0))
    devices = [f"cpu:{i}" for i in range(4)]
    with pytest.raises(ValueError, match="divisor of the number of devices .4.*vocab_shards=3"):
        training.VocabularyParallel(40, vocab_shards=3, devices=devices)
    with pytest.raises(ValueError, match="42 words.*4 vocabulary shards.*vocab_shards=4"):
        training.VocabularyParallel(42, vocab_shards=4, devices=devices)
    with pytest.raises(ValueError, match="vocab_size=0"):
        training.VocabularyParallel(0, devices=devices)
    if keras.backend.backend() != "jax":
        with pytest.raises(ValueError, match="KERAS_BACKEND=jax"):
            training.make_strategy("model_parallel", vocab_shards=2)


def _layout(variable):
    return list(variable.value.sharding.spec) + [None] * (
        len(variable.shape) - len(variable.value.sharding.spec))


def child():
    import tempfile

    from keras_softmax_heads.chunked import vocab_parallel
    from keras_softmax_heads.heads import head_utils

    originals = (head_utils.vocab_parallel_summed, vocab_parallel.vocab_parallel_mixture)

    # Whether each `predict` got a callback that handles its batch ends.
    predicts = []
    predict = keras.Model.predict

    def recording_predict(self, *args, callbacks=None, **kwargs):
        predicts.append(any(type(c).on_predict_batch_end
                            is not keras.callbacks.Callback.on_predict_batch_end
                            for c in callbacks or []))
        return predict(self, *args, callbacks=callbacks, **kwargs)

    keras.Model.predict = recording_predict
    out = {}
    for i, name in enumerate(sys.argv[1:]):
        # "head", "head:bf16" (both runs under mixed_bfloat16) or
        # "head:chunked" (a head outside CHUNKED given `chunk_size` too).
        head, _, option = name.partition(":")
        precision = {"mixed_precision": "mixed_bfloat16"} if option == "bf16" else {}
        calls = []
        _count_summed_calls(head_utils, "vocab_parallel_summed", calls)
        count_calls(vocab_parallel, "vocab_parallel_mixture", calls)
        chunk_size = 16 if head in CHUNKED or option == "chunked" else None
        sharded_config = _config(head, chunk_size=chunk_size, strategy="model_parallel",
                                 vocab_shards=2, **precision)
        with tempfile.TemporaryDirectory() as tmp:
            keras.distribution.set_distribution(None)
            predicts.clear()
            sharded = training.train_and_evaluate(sharded_config, f"{tmp}/sharded")
            predicts_waiting = list(predicts)
            # The layouts: the same model built under the distribution the
            # run set.
            layouts = _layouts(training.build_model(sharded_config, _corpus())[0])
            if i == 0:
                # A run stopped after its first epoch resumes, sharded, from
                # its checkpoint to the uninterrupted run's end.
                first = training.train_and_evaluate(
                    _config(head, chunk_size=chunk_size, strategy="model_parallel",
                            vocab_shards=2, epochs=1), f"{tmp}/resumed")
                resumed = training.train_and_evaluate(sharded_config, f"{tmp}/resumed")
                # Its first epoch is the checkpoint's record (its seconds
                # too), not a new one.
                resumed["first_epoch_kept"] = resumed["history"][0] == first["history"][0]
            keras.distribution.set_distribution(None)
            single = training.train_and_evaluate(
                _config(head, chunk_size=chunk_size, **precision), f"{tmp}/single")
            a, b = (keras.saving.load_model(r["files"]["training_model"], compile=False)
                    for r in (sharded, single))
            errors = [float(np.max(np.abs(np.asarray(x) - np.asarray(y)))
                            / max(float(np.max(np.abs(np.asarray(y)))), 1e-6))
                      for x, y in zip(a.trainable_weights, b.trainable_weights)]
        head_utils.vocab_parallel_summed, vocab_parallel.vocab_parallel_mixture = originals
        runs = (sharded, single) + ((resumed,) if i == 0 else ())
        out[name] = {
            "head": head,
            "model": {k: sharded["model"][k] for k in ("data_parallel_devices", "vocab_shards")},
            "train_loss": [[h["train_loss"] for h in r["history"]] for r in runs],
            "test_nll": [r["test"]["nll"] for r in runs],
            "first_epoch_kept": resumed["first_epoch_kept"] if i == 0 else None,
            "weights_rel_err": max(errors),
            "vocab_parallel_calls": len(calls),
            "predicts_waiting": predicts_waiting,
            "layouts": layouts,
        }
    print(json.dumps(out))


def _corpus():
    from keras_softmax_heads.data import load_dataset

    return load_dataset("synthetic", None, **TINY_DATA)


def _layouts(model):
    """The mesh axes of the (sharded) model's embedding, the head's bias
    (`[V]`, where it has one), the embedding's Adam slots and the LSTM's
    kernel."""
    embedding = model.backbone.embedding.embeddings
    bias = [w for w in model.head.weights if w.path.endswith("/bias") and w.shape[0] == 40]
    lstm = next(w for w in model.backbone.weights if "lstm" in w.path and w.path.endswith("/kernel"))
    model.optimizer.build(model.trainable_variables)
    slots = [v for v in model.optimizer.variables
             if tuple(v.shape) == tuple(embedding.shape) and "embedding" in v.path]
    return {"embeddings": _layout(embedding), "bias": [_layout(b) for b in bias],
            "embeddings_slots": [_layout(v) for v in slots], "lstm_kernel": _layout(lstm)}


if __name__ == "__main__":
    child()
