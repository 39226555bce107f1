"""`train_and_evaluate` and `examples/train_lm.py`: smoke, exactness, resume."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_softmax_heads as ksh
from keras_softmax_heads import training
from keras_softmax_heads.models import LSTMLanguageModel

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_lm.py"

TINY_DATA = "vocab_size=40,num_train_tokens=3000,num_valid_tokens=400,num_test_tokens=401"
TINY_FLAGS = [
    f"--dataset_options={TINY_DATA}", "--embedding_dim=8", "--hidden_size=8",
    "--num_layers=1", "--batch_size=4", "--bptt=6", "--epochs=2",
    "--steps_per_epoch=5", "--verbose=2", "--num_diagnostic_contexts=50",
]


def _tiny_config(**overrides):
    values = dict(
        dataset_options=dict(vocab_size=40, num_train_tokens=3000,
                             num_valid_tokens=400, num_test_tokens=401),
        embedding_dim=8, hidden_size=8, num_layers=1, batch_size=4, bptt=6,
        epochs=2, steps_per_epoch=5, verbose=0, num_diagnostic_contexts=50,
        tensorboard=False,
    )
    values.update(overrides)
    return training.get_config(**values)


def _run_script(args, workdir, check=True, timeout=300, backend="tensorflow", **env):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND=backend,
               CUDA_VISIBLE_DEVICES="", **env)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), f"--model_dir={workdir}", *args],
        capture_output=True, text=True, env=env, timeout=timeout, cwd=str(REPO),
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"train_lm.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def _weights(workdir):
    return keras.saving.load_model(os.path.join(workdir, "model.keras")).get_weights()


# ----------------------------------------------------------------- the script
def test_script_smoke(tmp_path):
    """The whole example script, a few steps: the example never goes stale."""
    proc = _run_script(TINY_FLAGS + ["--checkpoint_every=3"], tmp_path)
    assert "test_perplexity" in proc.stdout and "gap_to_floor_nats" in proc.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    for split in ("valid", "test"):
        assert results[split]["tokens"] == (400 if split == "valid" else 401) - 1
        assert results[split]["perplexity"] == pytest.approx(np.exp(results[split]["nll"]))
        assert 1.0 < results[split]["perplexity"] < 40.0 * 1.5
        assert not results[split]["partial"]
    assert [h["epoch"] for h in results["history"]] == [1, 2]
    assert all(np.isfinite(h["valid_perplexity"]) for h in results["history"])
    diagnostics = results["diagnostics"]
    bands = diagnostics["entropy_per_frequency_band"]
    assert sum(b["tokens"] for b in bands) == results["test"]["tokens"]
    rank = diagnostics["empirical_rank"]
    assert rank["num_contexts"] == 50 and 1 <= rank["rank"] <= rank["linear_softmax_bound"]
    synthetic = diagnostics["synthetic"]
    assert synthetic["kl_to_truth"] > 0 and 0 <= synthetic["mode_matching"] <= 1
    assert synthetic["gap_to_floor"] == pytest.approx(
        results["test"]["nll"] - synthetic["test_floor"])
    assert results["training"]["global_steps"] == 10
    assert results["model"]["tied_embeddings"] is True
    assert (tmp_path / "model.keras").exists() and (tmp_path / "config.json").exists()
    checkpoints = sorted(os.listdir(tmp_path / "checkpoints"))
    # Every 3 steps (3, 6, 9) and at each epoch end (5, 10); the last 2 kept.
    assert checkpoints == ["ckpt-0000000009.npz", "ckpt-0000000010.npz"]


@pytest.mark.slow
def test_script_on_jax_data_parallel_resumes_after_sigkill(tmp_path):
    """The script under KERAS_BACKEND=jax, data parallel over two host
    devices (keras.distribution): it trains, evaluates exactly, and a run
    killed mid-epoch and resumed ends with the weights and results of an
    uninterrupted one."""
    flags = TINY_FLAGS + ["--strategy=data_parallel", "--checkpoint_every=3",
                          "--dropout=0.3"]
    env = dict(backend="jax", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = _run_script(flags + ["--kill_after_steps=4"], tmp_path / "killed",
                       check=False, **env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert os.listdir(tmp_path / "killed" / "checkpoints") == ["ckpt-0000000003.npz"]
    _run_script(flags, tmp_path / "killed", **env)
    _run_script(flags, tmp_path / "fresh", **env)
    resumed, fresh = (json.loads((tmp_path / d / "results.json").read_text())
                      for d in ("killed", "fresh"))
    assert fresh["model"]["backend"] == "jax"
    assert fresh["model"]["data_parallel_devices"] == 2
    first, last = fresh["history"][0], fresh["history"][-1]
    assert last["valid_perplexity"] < first["valid_perplexity"] < 40.0 * 1.5
    for split in ("valid", "test"):
        assert resumed[split]["nll"] == pytest.approx(fresh[split]["nll"], rel=1e-5)
    for a, b in zip(resumed["history"], fresh["history"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    # A tf.distribute strategy on JAX is refused with the alternative named.
    proc = _run_script(TINY_FLAGS + ["--strategy=mirrored"], tmp_path / "m",
                       check=False, **env)
    assert proc.returncode != 0 and "data_parallel" in proc.stderr


@pytest.mark.slow
def test_script_on_torch_with_dropout_resumes_exactly(tmp_path):
    """PyTorch, dropout on: a run killed mid-epoch and resumed ends with the
    results of an uninterrupted one (the backbones seed their `Dropout`
    layers; unseeded, torch drew the masks from its global generator, which
    no checkpoint restores, and the resumed run differed)."""
    pytest.importorskip("torch")
    flags = TINY_FLAGS + ["--checkpoint_every=3", "--dropout=0.3"]
    proc = _run_script(flags + ["--kill_after_steps=4"], tmp_path / "killed",
                       check=False, backend="torch")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    _run_script(flags, tmp_path / "killed", backend="torch")
    _run_script(flags, tmp_path / "fresh", backend="torch")
    resumed, fresh = (json.loads((tmp_path / d / "results.json").read_text())
                      for d in ("killed", "fresh"))
    assert fresh["model"]["backend"] == "torch"
    for split in ("valid", "test"):
        assert resumed[split]["nll"] == pytest.approx(fresh[split]["nll"], rel=1e-6)
    for a, b in zip(resumed["history"], fresh["history"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)


def test_evaluation_is_exact_stream_nll(tmp_path):
    """Test NLL with eval_batch_size=1 = one pass over the whole test stream
    (warmed up on the end of the valid split)."""
    config = _tiny_config(eval_batch_size=1, eval_bptt=7, dropout=0.2)
    results = training.train_and_evaluate(config, str(tmp_path))
    trained = keras.saving.load_model(os.path.join(tmp_path, "model.keras"))
    # A stateless copy reads the whole test split as one sequence.
    backbone_config = trained.backbone.get_config()
    backbone_config.update(stateful=False, batch_size=None)
    backbone = LSTMLanguageModel.from_config(backbone_config)
    head = trained.head.__class__.from_config(
        {**trained.head.get_config(), "token_embedding": backbone.token_embedding})
    model = ksh.HeadModel(backbone, head)
    model.build((1, None))
    model.set_weights(trained.get_weights())
    from keras_softmax_heads.data import load_dataset

    corpus = load_dataset("synthetic", **config.dataset_options)
    test = corpus.test
    # ... after the last `eval_warmup` tokens of the valid split (unscored).
    warmup = corpus.valid[len(corpus.valid) - config.eval_warmup:]
    stream = np.concatenate([warmup, test])
    h = backbone(stream[None, :-1])
    ll = np.asarray(head.log_likelihood(h, stream[None, 1:]))[:, len(warmup):]
    assert results["test"]["tokens"] == len(test) - 1
    assert results["test"]["nll"] == pytest.approx(-ll.mean(), rel=1e-5)


@pytest.mark.parametrize(
    "model", ["lstm", pytest.param("ngram", marks=pytest.mark.slow)])
def test_resume_after_sigkill_loses_nothing(tmp_path, model):
    """Killed mid-epoch (SIGKILL) and resumed == never interrupted."""
    flags = TINY_FLAGS + [
        f"--model={model}", "--ngram_order=3", "--dropout=0.3", "--checkpoint_every=3",
        "--epochs=2",
    ]
    killed = tmp_path / "killed"
    proc = _run_script(flags + ["--kill_after_steps=4"], killed, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    # The kill came after the mid-epoch checkpoint of step 3 (of 5).
    assert os.listdir(killed / "checkpoints") == ["ckpt-0000000003.npz"]
    assert not (killed / "results.json").exists()

    config = _tiny_config(model=model, ngram_order=3, dropout=0.3, checkpoint_every=3,
                          tensorboard=True)
    resumed = training.train_and_evaluate(config, str(killed))
    fresh = training.train_and_evaluate(config, str(tmp_path / "fresh"))
    for a, b in zip(_weights(killed), _weights(tmp_path / "fresh")):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for split in ("valid", "test"):
        assert resumed[split]["nll"] == pytest.approx(fresh[split]["nll"], rel=1e-6)
    for a, b in zip(resumed["history"], fresh["history"]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["valid_perplexity"] == pytest.approx(b["valid_perplexity"], rel=1e-6)


def test_finished_run_is_not_retrained_and_other_config_is_refused(tmp_path, capsys):
    config = _tiny_config(epochs=1, steps_per_epoch=2, validate_every_epoch=False)
    first = training.train_and_evaluate(config, str(tmp_path))
    stamp = (tmp_path / "results.json").stat().st_mtime_ns
    again = training.train_and_evaluate(config.replace(verbose=1), str(tmp_path))
    assert again.pop("already_finished") is True
    assert again == json.loads((tmp_path / "results.json").read_text())
    assert again["test"]["nll"] == pytest.approx(first["test"]["nll"], rel=1e-6)
    assert (tmp_path / "results.json").stat().st_mtime_ns == stamp  # nothing rewritten
    assert "already holds this finished run" in capsys.readouterr().out
    # Other settings: refused, naming the field, before anything is written.
    config_json = (tmp_path / "config.json").read_text()
    with pytest.raises(ValueError, match=r"hidden_size: 8 -> 9"):
        training.train_and_evaluate(config.replace(hidden_size=9), str(tmp_path))
    assert (tmp_path / "config.json").read_text() == config_json
    # More epochs: the finished run is resumed, not restarted.
    more = training.train_and_evaluate(config.replace(epochs=2), str(tmp_path))
    assert [h["epoch"] for h in more["history"]] == [1, 2] and "already_finished" not in more
    # overwrite=True: a new run, even with other settings.
    other = training.train_and_evaluate(config.replace(hidden_size=9), str(tmp_path),
                                        overwrite=True)
    assert other["config"]["hidden_size"] == 9 and len(other["history"]) == 1


#: The head options that resume the 0.3.0 mixture run: its biases.
OLD_MIXTURE_OPTIONS = {"num_components": 2, "use_latent_bias": True, "use_prior_bias": True}


def test_run_saved_by_0_3_resumes_with_its_head_options(tmp_path):
    """A mixture run killed under 0.3.0, whose default head had a latent bias
    (`tests/data/make_v0_3_run_fixture.sh`): today's default options are
    refused before anything is written, naming the option that resumes it;
    with that option it resumes and ends where the uninterrupted 0.3.0 run
    ended."""
    fixture = REPO / "tests" / "data" / "v0_3_mos_run"
    expected = json.loads((fixture / "expected.json").read_text())["uninterrupted"]
    workdir = tmp_path / "run"
    shutil.copytree(fixture / "checkpoints", workdir / "checkpoints")
    shutil.copy(fixture / "config.json", workdir / "config.json")
    config = _tiny_config(head="mos", head_options={"num_components": 2}, checkpoint_every=3)
    with pytest.raises(ValueError,
                       match=r"0\.3\.0 or before.*add use_latent_bias=true,use_prior_bias=true"):
        training.train_and_evaluate(config, str(workdir))
    assert sorted(os.listdir(workdir)) == ["checkpoints", "config.json"]
    resumed = training.train_and_evaluate(
        config.replace(head_options=OLD_MIXTURE_OPTIONS),
        str(workdir))
    assert resumed["version"] == ksh.__version__
    assert resumed["valid"]["nll"] == pytest.approx(expected["valid_nll"], rel=1e-5)
    assert resumed["test"]["nll"] == pytest.approx(expected["test_nll"], rel=1e-5)
    assert [h["train_loss"] for h in resumed["history"]] == pytest.approx(
        expected["train_loss"], rel=1e-5)
    # The run now carries its version: rerunning it is "already finished".
    again = training.train_and_evaluate(
        config.replace(head_options=OLD_MIXTURE_OPTIONS),
        str(workdir))
    assert again["already_finished"] is True


def test_read_saved_settings_fills_only_old_unnamed_defaults():
    old = {"head": "moc", "head_options": {"num_components": 3}}
    settings, filled = training.read_saved_settings(old, None)
    assert filled == {"use_latent_bias": True, "use_prior_bias": True}
    assert settings["head_options"] == {"num_components": 3, **filled}
    assert old == {"head": "moc", "head_options": {"num_components": 3}}  # not modified
    # Saved with a version (0.4 on), named explicitly, or another head: as saved.
    assert training.read_saved_settings(old, "0.4.0") == (old, {})
    named = {"head": "mixture_of_softmaxes",
             "head_options": {"use_latent_bias": False, "use_prior_bias": True}}
    assert training.read_saved_settings(named, None) == (named, {})
    plif = {"head": "plif", "head_options": {}}
    assert training.read_saved_settings(plif, None) == (plif, {})
    assert training.read_saved_settings({"head": "no_such_head"}, None)[1] == {}
    # The hint names the option only where the head options differ.
    from keras_softmax_heads.training.config import old_defaults_hint

    assert "add use_latent_bias=true" in old_defaults_hint(filled, settings, old)
    assert old_defaults_hint(filled, settings, settings) == ""
    assert old_defaults_hint({}, settings, old) == ""


def test_ptb_smoke(shared_data_dir, tmp_path, capsys):
    config = training.get_config(
        "zaremba_small", dataset="ptb", data_dir=str(shared_data_dir / "ptb"),
        hidden_size=16, embedding_dim=16, epochs=1, steps_per_epoch=3,
        eval_steps=2, eval_batch_size=4, eval_warmup=0, verbose=1, tensorboard=False,
        num_diagnostic_contexts=64)
    results = training.train_and_evaluate(config, str(tmp_path))
    assert results["corpus"]["vocab_size"] == 10000
    assert results["test"]["partial"] and results["test"]["tokens"] == 2 * 4 * 50
    # The log says the evaluation was cut short, as results.json does.
    assert "400 test tokens, partial: the first windows only" in capsys.readouterr().out
    assert 100 < results["test"]["perplexity"] < 1e5  # barely trained, finite
    assert results["model"]["tied_embeddings"] is False
    assert "synthetic" not in results["diagnostics"]
    assert len(results["diagnostics"]["entropy_per_frequency_band"]) == 5


def test_bad_data_errors_are_clear(tmp_path):
    config = _tiny_config(bptt=1000)
    with pytest.raises(ValueError, match="bptt=1000"):
        training.train_and_evaluate(config, str(tmp_path))
    with pytest.raises(ValueError, match="batch_size"):
        training.train_and_evaluate(_tiny_config(model="ngram", batch_size=5000), str(tmp_path))
    with pytest.raises(ValueError, match="Unknown dataset"):
        training.train_and_evaluate(_tiny_config(dataset="nope", dataset_options={}), str(tmp_path))


# ---------------------------------------------------------------- the config
def test_presets_and_validation():
    small = training.get_config("zaremba_small")
    assert (small.hidden_size, small.num_layers, small.bptt, small.batch_size) == (200, 2, 20, 20)
    assert (small.epochs, small.init_scale, small.clip_norm, small.dropout) == (13, 0.1, 5.0, 0.0)
    assert small.tie_embeddings is False and small.optimizer == "sgd"
    rates = [training.epoch_learning_rate(small, e) for e in range(13)]
    assert rates[:4] == [1.0] * 4 and rates[4] == 0.5 and rates[12] == pytest.approx(0.5 ** 9)
    medium = training.get_config("zaremba_medium")
    assert (medium.hidden_size, medium.bptt, medium.epochs, medium.dropout) == (650, 35, 39, 0.5)
    assert training.epoch_learning_rate(medium, 6) == pytest.approx(1 / 1.2)
    assert training.epoch_learning_rate(medium, 5) == 1.0
    with pytest.raises(ValueError, match="Unknown preset"):
        training.get_config("nope")
    with pytest.raises(ValueError, match="Unknown TrainConfig fields"):
        training.get_config(hidden=3)
    bad = [
        dict(optimizer="adam", loss_reduction="sum_over_time"),
        dict(strategy="gpu"),
        dict(head="nope"),
        dict(bptt=0),
        dict(mixed_precision="float16"),
        dict(band_fractions=(0.5, 0.2)),
    ]
    for overrides in bad:
        with pytest.raises(ValueError):
            training.validate_config(training.get_config(**overrides))


def test_sum_over_time_rescaling_is_exact_sgd():
    """Zaremba's loss (sum over time of the batch mean) with SGD(lr, clip) ==
    HeadModel's token mean with SGD(lr * T, clip / T)."""
    config = training.get_config("zaremba_small", bptt=5, clip_norm=0.05)
    keras.utils.set_random_seed(0)
    backbone = LSTMLanguageModel(vocab_size=30, embedding_dim=4, hidden_size=4,
                                 num_layers=1, stateful=False)
    model = ksh.HeadModel(backbone, ksh.FullSoftmax(30))
    model.build((2, 5))
    start = model.get_weights()
    x = np.random.default_rng(0).integers(0, 30, (2, 5))
    y = np.roll(x, -1, 1)
    with tf.GradientTape() as tape:
        ll = model.head.log_likelihood(backbone(x), y)
        loss = -tf.reduce_sum(tf.reduce_mean(ll, axis=0))  # sum_t mean_b
    grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
    grads, norm = tf.clip_by_global_norm(grads, config.clip_norm)
    assert float(norm) > config.clip_norm  # the clipping is exercised
    expected = [np.asarray(v) - config.learning_rate * np.asarray(g)
                for v, g in zip(model.trainable_variables, grads)]
    model.set_weights(start)
    model.compile(training.make_optimizer(config))
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    for v, e in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(np.asarray(v), e, atol=1e-6)


def test_eval_windows_cover_every_target_once():
    from keras_softmax_heads.data import load_dataset

    corpus = load_dataset("synthetic", vocab_size=20, num_train_tokens=100,
                          num_valid_tokens=50, num_test_tokens=37)
    ids = corpus.test
    for model, batch in [("lstm", 1), ("lstm", 3), ("lstm", 40), ("ngram", 8)]:
        config = training.get_config(model=model, bptt=4, ngram_order=3)
        tokens, targets, position = training.eval_windows(config, corpus, ids, batch)
        valid = position >= 0
        assert sorted(position[valid]) == list(range(len(ids) - 1))
        np.testing.assert_array_equal(targets[valid], ids[position[valid] + 1])
        last = tokens[valid] if model == "lstm" else tokens[valid][:, -1]
        np.testing.assert_array_equal(last, ids[position[valid]])


@pytest.mark.parametrize("batch,warmup,bptt", [(1, 5, 4), (3, 5, 4), (4, 7, 3), (5, 40, 4), (40, 3, 4)])
def test_eval_windows_warm_up_streams_on_the_split(batch, warmup, bptt):
    """With `eval_warmup=W`, every target is scored once, and every stream
    but the first reads the W split tokens before its first target (no cold
    start); stream 0 starts at the split's first token."""
    ids = np.random.default_rng(0).integers(0, 20, 37).astype(np.int32)
    config = training.get_config(bptt=bptt, eval_warmup=warmup)
    tokens, targets, position = training.eval_windows(config, None, ids, batch)
    valid = position >= 0
    assert sorted(position[valid]) == list(range(len(ids) - 1))
    np.testing.assert_array_equal(targets[valid], ids[position[valid] + 1])
    np.testing.assert_array_equal(tokens[valid], ids[position[valid]])
    rows = tokens.transpose(1, 0, 2).reshape(batch, -1)
    pos = position.transpose(1, 0, 2).reshape(batch, -1)
    assert pos[0, 0] == 0
    for b in range(1, batch):
        if not (pos[b] >= 0).any():
            continue
        first = int(np.argmax(pos[b] >= 0))
        start = pos[b, first]
        assert first == min(warmup, len(ids) - 1)  # warm-up tokens, unscored
        np.testing.assert_array_equal(rows[b, :first + 1], ids[start - first:start + 1])


@pytest.mark.parametrize("batch,warmup,bptt", [(1, 5, 4), (4, 5, 4), (3, 0, 5), (5, 40, 3)])
def test_eval_windows_warm_the_first_stream_on_the_previous_split(batch, warmup, bptt):
    """With the previous split given, stream 0 first reads its last W tokens
    (unscored), then scores the split from its first target; every target
    is still scored once and from the split's own tokens."""
    rng = np.random.default_rng(1)
    previous = rng.integers(0, 20, 30).astype(np.int32)
    ids = rng.integers(0, 20, 37).astype(np.int32)
    config = training.get_config(bptt=bptt, eval_warmup=warmup)
    tokens, targets, position = training.eval_windows(config, None, ids, batch, previous=previous)
    valid = position >= 0
    assert sorted(position[valid]) == list(range(len(ids) - 1))
    np.testing.assert_array_equal(targets[valid], ids[position[valid] + 1])
    np.testing.assert_array_equal(tokens[valid], ids[position[valid]])
    row0 = tokens.transpose(1, 0, 2).reshape(batch, -1)[0]
    pos0 = position.transpose(1, 0, 2).reshape(batch, -1)[0]
    first = int(np.argmax(pos0 >= 0))
    read = min(warmup, len(previous))  # a shorter previous split is read whole
    assert first == read and pos0[first] == 0
    np.testing.assert_array_equal(row0[:first], previous[len(previous) - read:])
    without = training.eval_windows(config, None, ids, batch)
    if warmup == 0:  # nothing to read before the split: the same windows
        for a, b in zip(without, (tokens, targets, position)):
            np.testing.assert_array_equal(a, b)


def test_zaremba_presets_keep_the_papers_zero_state_evaluation():
    for name in ("zaremba_small", "zaremba_medium", "zaremba_large"):
        assert training.get_config(name).eval_warmup == 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["lstm", "ngram"])
def test_every_available_head_trains_and_evaluates(tmp_path, model):
    from keras_softmax_heads.heads import registry

    for name in registry.available_heads():
        config = _tiny_config(head=name, model=model, ngram_order=3, epochs=1,
                              steps_per_epoch=3, validate_every_epoch=False,
                              chunk_size=16)
        results = training.train_and_evaluate(config, str(tmp_path / name))
        assert np.isfinite(results["test"]["nll"]), name
        assert results["model"]["tied_embeddings"] == registry.supports_tying(name)


# ----------------------------------------------------------------- the flags
def _parse_flags(*args):
    from absl import flags

    flag_values = flags.FlagValues()
    training.define_flags(flag_values)
    flag_values(["train_lm.py", *args])
    return flag_values


def test_every_config_field_has_a_flag_with_its_default_and_help():
    import dataclasses

    flag_values = _parse_flags()
    defaults = training.TrainConfig()
    for field in dataclasses.fields(training.TrainConfig):
        assert field.name in flag_values, field.name
        assert field.metadata["help"], field.name
        assert field.metadata["help"] in flag_values[field.name].help, field.name
        assert flag_values[field.name].value == getattr(defaults, field.name), field.name
    assert "preset" in flag_values
    # Nothing given: the defaults, exactly.
    assert training.config_from_flags(flag_values) == defaults


def test_flags_preset_then_explicit_flags():
    config = training.config_from_flags(_parse_flags("--preset=zaremba_small", "--epochs=2"))
    assert config == training.get_config("zaremba_small", epochs=2)
    # A flag left out keeps the preset's value, not the flag's default.
    assert (config.hidden_size, config.clip_norm, config.tie_embeddings) == (200, 5.0, False)
    assert config.optimizer == "sgd" and config.eval_batch_size == 1


def test_flags_parse_bool_none_dict_tuple():
    config = training.config_from_flags(_parse_flags(
        "--head_options=static_shapes=false,num_knots=10,clustering=frequency",
        "--dataset_options=vocab_size=40,verify_checksums=FALSE",
        "--band_fractions=0.1,0.5", "--notensorboard", "--deterministic=true",
        "--tie_embeddings=true", "--unroll=auto", "--jit_compile=false",
        "--embedding_dropout=0.25", "--hidden_dropout=none", "--clip_norm=0",
        "--checkpoint_every=0", "--eval_bptt=7", "--mixed_precision=mixed_bfloat16",
        "--loss_reduction=mean", "--data_dir=/tmp/x",
    ))
    assert config.head_options == {"static_shapes": False, "num_knots": 10,
                                   "clustering": "frequency"}
    assert config.dataset_options == {"vocab_size": 40, "verify_checksums": False}
    assert config.band_fractions == (0.1, 0.5)
    assert config.tensorboard is False and config.deterministic is True
    assert config.tie_embeddings is True and config.unroll is None
    assert config.jit_compile is False
    assert config.embedding_dropout == 0.25 and config.hidden_dropout is None
    assert config.clip_norm is None and config.checkpoint_every is None
    assert config.eval_bptt == 7 and config.mixed_precision == "mixed_bfloat16"
    assert config.data_dir == "/tmp/x"
    config = training.config_from_flags(_parse_flags(
        "--preset=zaremba_small", "--unroll=true", "--tie_embeddings=none",
        "--jit_compile=auto", "--eval_batch_size=None", "--mixed_precision=none"))
    assert config.unroll is True and config.tie_embeddings is None
    assert config.jit_compile == "auto" and config.eval_batch_size is None
    assert config.mixed_precision is None
    for bad in ("--unroll=maybe", "--optimizer=lbfgs", "--batch_size=none",
                "--band_fractions=0.1,x"):
        with pytest.raises(Exception, match="flag"):
            _parse_flags(bad)


def test_parse_options_words():
    assert training.parse_options("a=true,b=False,c=NONE,d=None,e=nonesuch") == {
        "a": True, "b": False, "c": None, "d": None, "e": "nonesuch"}
    assert training.parse_options("x='false',y=[1, 2]") == {"x": "false", "y": [1, 2]}
    assert training.parse_options({"k": 1}) == {"k": 1} and training.parse_options(None) == {}


def test_resumable_fields():
    assert training.RESUMABLE_FIELDS == {
        "epochs", "train_seconds", "verbose", "checkpoint_every", "keep_checkpoints", "tensorboard",
        "kill_after_steps", "kill_signal", "eval_steps", "eval_batch_size", "eval_bptt",
        "eval_warmup",
        "strategy", "tpu", "vocab_shards", "jit_compile", "steps_per_execution",
        "validate_every_epoch", "band_fractions", "num_diagnostic_contexts",
        "data_dir", "deterministic", "mixed_precision", "unroll",
    }


# ------------------------------------------------ inference model, resuming
def test_inference_model_is_stateless_and_equals_the_trained_model(tmp_path):
    """`inference_model.keras`: any batch size, the same log-probabilities
    twice, equal to the stateful training model's from a zero state; the
    README's "Use the trained model" code path (vocab.txt, scoring,
    sampling)."""
    config = _tiny_config(epochs=1, steps_per_epoch=3, validate_every_epoch=False)
    results = training.train_and_evaluate(config, str(tmp_path))
    files = results["files"]
    assert files["inference_model"] == os.path.join(str(tmp_path), "inference_model.keras")
    inference = keras.saving.load_model(files["inference_model"])
    trained = keras.saving.load_model(files["training_model"])  # stateful, batch 4
    from keras_softmax_heads.data import load_dataset

    corpus = load_dataset("synthetic", **config.dataset_options)
    windows = corpus.test[:4 * 6].reshape(4, 6)
    first = inference.predict(windows[:2], verbose=0)
    second = inference.predict(windows[:2], verbose=0)
    np.testing.assert_array_equal(first, second)  # no state carried
    assert first.shape == (2, 6, 40)
    trained.backbone.reset_states()
    expected = np.asarray(trained(windows))[:2]
    np.testing.assert_allclose(first, expected, rtol=1e-5, atol=1e-5)
    # A longer context than the training windows, one row.
    assert inference.predict(corpus.test[None, :50], verbose=0).shape == (1, 50, 40)

    # The README snippet's code path.
    from keras_softmax_heads.data import Vocabulary

    vocab = Vocabulary.load(files["vocabulary"])
    assert vocab.tokens == corpus.vocab.tokens
    words = vocab.decode(corpus.test[:8])
    ids = vocab.encode(words)
    log_probs = inference.predict(ids[None, :-1], verbose=0)[0]  # [T - 1, V]
    score = float(np.sum(log_probs[np.arange(len(ids) - 1), ids[1:]]))
    assert np.isfinite(score) and score < 0
    rng = np.random.default_rng(0)
    context = list(ids)
    for _ in range(5):
        p = np.exp(inference.predict(np.array([context]), verbose=0)[0, -1].astype("float64"))
        context.append(int(rng.choice(len(p), p=p / p.sum())))
    assert len(vocab.decode(context[len(ids):])) == 5


def test_sigterm_and_damaged_checkpoint_resume_exactly(tmp_path, capsys):
    """In process: SIGTERM at step 7 saves a checkpoint of step 7 and raises
    `TrainingInterrupted`; that newest checkpoint truncated, the resume
    names it, falls back to step 6 and ends as an uninterrupted run."""
    config = _tiny_config(checkpoint_every=2, dropout=0.3)
    workdir = tmp_path / "interrupted"
    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    with pytest.raises(training.TrainingInterrupted) as info:
        training.train_and_evaluate(
            config.replace(kill_after_steps=7, kill_signal=int(signal.SIGTERM)), str(workdir))
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    assert info.value.global_step == 7 and info.value.exit_code == 143
    assert str(info.value) == ("Interrupted at step 7 (SIGTERM); checkpoint saved. "
                               "Rerun the same command to resume.")
    checkpoints = workdir / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["ckpt-0000000006.npz", "ckpt-0000000007.npz"]
    newest = checkpoints / "ckpt-0000000007.npz"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    capsys.readouterr()
    resumed = training.train_and_evaluate(config.replace(verbose=1), str(workdir))
    out = capsys.readouterr()
    assert f"Skipping damaged checkpoint {newest}" in out.err
    assert "Resuming from step 6 (epoch 2, step 1 of 5)" in out.out
    assert (checkpoints / "ckpt-0000000007.npz.damaged").exists()
    fresh = training.train_and_evaluate(config, str(tmp_path / "fresh"))
    for split in ("valid", "test"):
        assert resumed[split]["nll"] == pytest.approx(fresh[split]["nll"], rel=1e-6)
    # No readable checkpoint at all: one clear refusal.
    bad = tmp_path / "bad"
    (bad / "checkpoints").mkdir(parents=True)
    (bad / "checkpoints" / "ckpt-0000000003.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="No readable checkpoint.*overwrite"):
        training.train_and_evaluate(config, str(bad))
    assert not (bad / "config.json").exists()


@pytest.mark.slow
def test_script_sigterm_checkpoints_exits_143_and_resumes(tmp_path):
    """The script stopped by SIGTERM mid-epoch (sent at step 4 by the test
    switch): one line, status 143, a checkpoint of step 4; the same command
    resumes from step 4 and ends as an uninterrupted run."""
    flags = TINY_FLAGS + ["--dropout=0.3", "--checkpoint_every=3"]
    proc = _run_script(flags + ["--kill_after_steps=4", "--kill_signal=15"], tmp_path,
                       check=False)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "Interrupted at step 4 (SIGTERM); checkpoint saved. Rerun the same command to resume.")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [
        "ckpt-0000000003.npz", "ckpt-0000000004.npz"]
    proc = _run_script(flags, tmp_path)
    assert "Resuming from step 4 (epoch 1, step 4 of 5)" in proc.stdout
    resumed = json.loads((tmp_path / "results.json").read_text())
    fresh = training.train_and_evaluate(
        _tiny_config(dropout=0.3, checkpoint_every=3), str(tmp_path / "fresh"))
    for split in ("valid", "test"):
        assert resumed[split]["perplexity"] == pytest.approx(fresh[split]["perplexity"], rel=1e-6)
    # The same command again: a finished run, not retrained.
    proc = _run_script(flags, tmp_path)
    assert proc.stdout.strip().splitlines()[-1] == f"Already finished: {tmp_path}/results.json"


def test_script_data_errors_are_one_line(tmp_path):
    """Expected errors (here a missing data directory) print `error: ...`
    and exit 2, without a traceback; `--dataset_options` parses `false`."""
    proc = _run_script(["--dataset=ptb", f"--data_dir={tmp_path / 'nope'}",
                        "--dataset_options=verify_checksums=false"], tmp_path / "run",
                       check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: Data directory not found: '{tmp_path / 'nope'}'")


@pytest.mark.slow
def test_script_external_sigterm_mid_epoch_resumes_exactly(tmp_path):
    """A SIGTERM from outside (as from a scheduler), sent once the log shows
    epoch 1 validated: the script stops at a step of epoch 2 with a
    checkpoint, exits 143; the same command resumes from that step and ends
    as an uninterrupted run."""
    flags = [f for f in TINY_FLAGS if not f.startswith("--steps_per_epoch")] + [
        "--steps_per_epoch=100", "--checkpoint_every=1000", "--dropout=0.3"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KERAS_BACKEND="tensorflow",
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), f"--model_dir={tmp_path}", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO))
    for line in proc.stdout:
        if "valid perplexity" in line:
            proc.send_signal(signal.SIGTERM)
            break
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("Interrupted at step ") and last.endswith(
        "(SIGTERM); checkpoint saved. Rerun the same command to resume."), last
    step = int(last.split()[3])
    assert 100 <= step <= 200  # 100, 200: at an epoch's end, after its checkpoint
    resumed = _run_script(flags, tmp_path)
    assert f"Resuming from step {step} " in resumed.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    fresh = training.train_and_evaluate(
        _tiny_config(steps_per_epoch=100, checkpoint_every=1000, dropout=0.3),
        str(tmp_path / "fresh"))
    for split in ("valid", "test"):
        assert results[split]["perplexity"] == pytest.approx(fresh[split]["perplexity"], rel=1e-6)


def test_eval_steps_counts_scoring_windows_after_the_warm_up(tmp_path):
    """A smoke-run cap on evaluation windows still scores targets when the
    warm-up is longer than the capped windows (it used to leave none)."""
    config = _tiny_config(epochs=1, steps_per_epoch=2, eval_steps=1, eval_warmup=40,
                          validate_every_epoch=False, num_diagnostic_contexts=5)
    results = training.train_and_evaluate(config, str(tmp_path))
    for split in ("valid", "test"):
        assert results[split]["partial"] and results[split]["tokens"] > 0
        assert np.isfinite(results[split]["nll"])
    assert results["diagnostics"]["empirical_rank"]["num_contexts"] == 5
