"""`tf.distribute` strategies (TensorFlow), `keras.distribution` data
parallelism (JAX), this process' place in a cluster, and how global batches
are split between replicas."""

from __future__ import annotations

import keras

#: Names accepted by `make_strategy` (and `TrainConfig.strategy`).
DISTRIBUTION_STRATEGIES = ("default", "mirrored", "multi_worker", "tpu", "data_parallel")

#: The strategies that are `tf.distribute` strategies (TensorFlow backend).
TF_STRATEGIES = ("mirrored", "multi_worker", "tpu")


def make_strategy(name="default", tpu=None):
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

    The first three are `tf.distribute` strategies and need the TensorFlow
    backend; `"data_parallel"` needs JAX (Keras' distribution API).

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
    if name == "data_parallel":
        if backend != "jax":
            raise ValueError(
                "strategy='data_parallel' uses keras.distribution, which needs "
                f"KERAS_BACKEND=jax (the current backend is {backend!r}). On "
                "TensorFlow use strategy='mirrored'."
            )
        devices = keras.distribution.list_devices()
        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=devices)
        )
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


def data_parallel_devices():
    """Devices the global `keras.distribution` splits each batch across
    (`strategy="data_parallel"`), or 1 when there is none."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        return 1
    return int(distribution.device_mesh.devices.size)


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
