"""`tf.distribute` strategies (TensorFlow), `keras.distribution` data and
vocabulary parallelism (JAX), this process' place in a cluster, and how
global batches are split between replicas."""

from __future__ import annotations

import keras

#: Names accepted by `make_strategy` (and `TrainConfig.strategy`).
DISTRIBUTION_STRATEGIES = ("default", "mirrored", "multi_worker", "tpu", "data_parallel",
                           "model_parallel")

#: The strategies that are `tf.distribute` strategies (TensorFlow backend).
TF_STRATEGIES = ("mirrored", "multi_worker", "tpu")


def make_strategy(name="default", tpu=None, vocab_shards=None):
    """The `tf.distribute` strategy `name` (see `DISTRIBUTION_STRATEGIES`).

    * `"default"`: the default (single-device) strategy.
    * `"mirrored"`: `MirroredStrategy` over the local GPUs, or over the
      logical CPU devices when there is no GPU.
    * `"multi_worker"`: `MultiWorkerMirroredStrategy` (cluster from
      `TF_CONFIG`).
    * `"tpu"`: the official recipe: `TPUClusterResolver(tpu=...)`,
      `experimental_connect_to_cluster`, `initialize_tpu_system`,
      `TPUStrategy`. `tpu` is the TPU's name or `grpc://` address, or
      `"local"` (default) on a TPU VM.
    * `"data_parallel"` (JAX backend): sets Keras' global distribution to
      `keras.distribution.DataParallel` over all local devices (on a TPU VM
      its cores; on a CPU, `XLA_FLAGS=--xla_force_host_platform_device_count=N`
      makes N host devices) and returns the default `tf.distribute`
      strategy, which then only feeds the `tf.data` input.
    * `"model_parallel"` (JAX backend): checks that `vocab_shards` (None:
      all local devices) divides the number of local devices and returns
      the default strategy; `train_and_evaluate` then sets a
      `VocabularyParallel` distribution once the corpus (its vocabulary
      size) is loaded: every vocabulary-sized weight split over
      `vocab_shards` devices, the batch over the rest.

    The first three are `tf.distribute` strategies and need the TensorFlow
    backend; the last two need JAX (Keras' distribution API).

    Raises:
        RuntimeError: `"tpu"` when no TPU can be reached (the message says
            what was tried).
        ValueError: a strategy the current Keras backend cannot run.
    """
    import tensorflow as tf

    backend = keras.backend.backend()
    if name in TF_STRATEGIES and backend != "tensorflow":
        raise ValueError(
            f"strategy={name!r} is a tf.distribute strategy: it needs "
            f"KERAS_BACKEND=tensorflow (the current backend is {backend!r}). "
            "On JAX use strategy='data_parallel' (keras.distribution)."
        )
    if name in ("data_parallel", "model_parallel"):
        if backend != "jax":
            raise ValueError(
                f"strategy={name!r} uses keras.distribution, which needs "
                f"KERAS_BACKEND=jax (the current backend is {backend!r}). On "
                "TensorFlow use strategy='mirrored'."
            )
        devices = keras.distribution.list_devices()
        if name == "data_parallel":
            keras.distribution.set_distribution(
                keras.distribution.DataParallel(devices=devices)
            )
        else:
            vocabulary_mesh_shape(len(devices), vocab_shards)  # checks
        return tf.distribute.get_strategy()
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "mirrored":
        gpus = tf.config.list_logical_devices("GPU")
        devices = [d.name for d in (gpus or tf.config.list_logical_devices("CPU"))]
        return tf.distribute.MirroredStrategy(devices=devices)
    if name == "multi_worker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "tpu":
        address = "local" if tpu in (None, "") else tpu
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
            tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
        except Exception as e:  # resolver/connection errors vary by setup
            raise RuntimeError(
                f"Could not connect to the TPU {address!r} "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}). "
                "Run on a Cloud TPU VM with --tpu=local, or pass the TPU's name "
                "or grpc:// address with --tpu. See tpu_scripts/README.md."
            ) from e
        return tf.distribute.TPUStrategy(resolver)
    raise ValueError(
        f"Unknown strategy. Expected one of {list(DISTRIBUTION_STRATEGIES)}. Received: {name!r}")


def vocabulary_mesh_shape(num_devices, vocab_shards=None):
    """`(batch, model)`: the device mesh of `VocabularyParallel` over
    `num_devices` devices, `vocab_shards` of them (None or 0: all) on the
    vocabulary axis."""
    shards = num_devices if vocab_shards in (None, 0) else vocab_shards
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1 \
            or num_devices % shards:
        raise ValueError(
            "`vocab_shards` must be a positive divisor of the number of devices "
            f"({num_devices}), or None for all of them. Received: vocab_shards={vocab_shards!r}")
    return num_devices // shards, shards


class VocabularyParallel(keras.distribution.ModelParallel):
    """A `keras.distribution.ModelParallel` that splits every trainable
    weight with a vocabulary-sized axis over the devices of its `"model"`
    mesh axis, and each batch over its `"batch"` axis (JAX).

    The weights so split are the output layer's: the `[V, d]` (tied)
    embedding, a head's `[d, V]` kernel, its `[V]` bias, and their
    optimizer slots (which take their variable's layout); everything else
    is replicated. Each device then holds `1 / vocab_shards` of the
    weights, gradients and optimizer state that grow with the vocabulary.
    A weight's vocabulary axis is its first if that has `vocab_size`
    entries, else its last that has. Non-trainable tables (the sampled
    heads' alias tables, the word orders of the adaptive heads) stay
    replicated.

    What runs on each device's shard: with `chunk_size`, the summed
    training objective and the per-token log-likelihood (evaluation) of
    `FullSoftmax`, `SigSoftmax`, `PLIFSoftmax` and the mixtures of
    softmaxes run vocabulary-parallel (`jax.shard_map`, per-token
    statistics combined by all-reduces: `docs/chunked.md`, "Sharding",
    `docs/mixtures.md`, "Vocabulary-parallel"); everything else is
    partitioned by XLA from these layouts, which may gather a matrix
    where it needs it (correct, without the memory saving in that
    computation).

    Layouts in `layout_map` (optional, a `keras.distribution.LayoutMap` over
    this mesh, or a dict of path regexes to axis tuples) take precedence.

    Args:
        vocab_size: the vocabulary size `V`; `V % vocab_shards == 0`.
        vocab_shards: devices on the vocabulary (`"model"`) axis; the other
            `len(devices) / vocab_shards` split the batch. None or 0: all.
        devices: the devices (default: `keras.distribution.list_devices()`).
        layout_map: explicit layouts that override the rule.

    Example (`keras.distribution.set_distribution(VocabularyParallel(...))`
    makes the layers built from then on take these layouts):

    >>> import keras
    >>> from keras_softmax_heads.training import VocabularyParallel
    >>> distribution = VocabularyParallel(vocab_size=1000, devices=["cpu:0"])
    >>> distribution.get_variable_layout(keras.Variable("zeros", shape=(64, 1000))).axes
    (None, 'model')
    >>> distribution.get_variable_layout(keras.Variable("zeros", shape=(1000, 64))).axes
    ('model', None)
    >>> distribution.get_variable_layout(keras.Variable("zeros", shape=(64, 256))).axes
    (None, None)
    """

    def __init__(self, vocab_size, vocab_shards=None, devices=None, layout_map=None):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"`vocab_size` must be a positive int. Received: vocab_size={vocab_size!r}")
        devices = list(devices) if devices is not None else keras.distribution.list_devices()
        shape = vocabulary_mesh_shape(len(devices), vocab_shards)
        if vocab_size % shape[1]:
            raise ValueError(
                f"The vocabulary ({vocab_size} words) must split evenly over the "
                f"{shape[1]} vocabulary shards: choose vocab_shards among the divisors of "
                f"{vocab_size} that divide the {len(devices)} devices. Received: "
                f"vocab_size={vocab_size}, vocab_shards={vocab_shards!r}")
        mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
        layouts = keras.distribution.LayoutMap(mesh)
        for path, axes in dict(layout_map or {}).items():
            layouts[path] = axes
        super().__init__(layout_map=layouts, batch_dim_name="batch")
        self.vocab_size = vocab_size
        self.vocab_shards = shape[1]

    def get_variable_layout(self, variable):
        layout = super().get_variable_layout(variable)
        if any(axis is not None for axis in layout.axes) or not variable.trainable:
            return layout
        shape = tuple(variable.shape)
        axes = [i for i, size in enumerate(shape) if size == self.vocab_size]
        if not axes:
            return layout
        spec = [None] * len(shape)
        spec[0 if axes[0] == 0 else axes[-1]] = "model"
        return keras.distribution.TensorLayout(spec, self.device_mesh)


def data_parallel_devices():
    """Devices (model replicas) the global `keras.distribution` splits each
    batch across (`strategy="data_parallel"`: all; `"model_parallel"`: the
    mesh's batch axis), or 1 when there is none."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    return int(distribution.num_model_replicas)


def vocabulary_shards():
    """Devices the global `keras.distribution` splits the vocabulary-sized
    weights across (a `VocabularyParallel`'s `vocab_shards`), or 1."""
    return int(getattr(keras.distribution.distribution(), "vocab_shards", 1))


def worker_info(strategy):
    """`(is_chief, task_id)` of this process in a multi-worker cluster.

    `(True, 0)` for every strategy but `MultiWorkerMirroredStrategy`. In a
    cluster, the chief is the `"chief"` task, or worker 0 when there is
    none; `task_id` numbers the chief 0 and the workers after it.
    """
    import tensorflow as tf

    resolver = getattr(strategy, "cluster_resolver", None)
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or resolver is None:
        return True, 0
    task_type, task_id = resolver.task_type, resolver.task_id or 0
    if task_type is None:
        return True, 0
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    is_chief = task_type == "chief" or (task_type == "worker" and task_id == 0 and not has_chief)
    return is_chief, (0 if task_type == "chief" else task_id + (1 if has_chief else 0))


def distribute_dataset(strategy, make_dataset):
    """Distributes a dataset of global batches so that, in every step,
    replica `r` (of `R`) gets rows `[r*B/R, (r+1)*B/R)` of the global batch.

    The same rows go to the same replica in every step, so each replica's
    carried LSTM state continues its own streams; the result equals
    single-device training. `make_dataset()` builds the global-batch dataset
    (static shapes) and is called once per input pipeline (worker). With
    one replica, the dataset itself is returned.
    """
    import tensorflow as tf

    if strategy.num_replicas_in_sync == 1:
        return make_dataset()

    def fn(ctx):
        ds = make_dataset()
        local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        first = ctx.input_pipeline_id * local

        def split(*element):
            element = element[0] if len(element) == 1 else element

            def cut(t):
                rows = t.shape[0] // ctx.num_replicas_in_sync
                mine = t[first * rows:(first + local) * rows]
                return tf.reshape(mine, [local, rows] + t.shape[1:].as_list())
            return tf.nest.map_structure(cut, element)

        return ds.map(split).unbatch().prefetch(2)

    return strategy.distribute_datasets_from_function(fn)
