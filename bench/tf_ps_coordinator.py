"""TF's ParameterServerStrategy on its tutorial's shape; run by bench/ps_coordinator.py where ``import tensorflow`` works.

    .venv-tf/bin/python bench/tf_ps_coordinator.py STEPS

The tutorial's in-process cluster (2 workers, 2 servers: TF servers in this one process, as the
tutorial makes them), its model (an embedding of 8 x 16,384 averaged over 3 words, a sigmoid
unit) on the same synthetic batches of 32, Adagrad(0.001); 10 warm-up steps, then STEPS steps
scheduled with ClusterCoordinator and joined, timed. Prints one JSON line. ``make bench-tf``
installs TensorFlow (tensorflow-cpu) in ``.venv-tf``; where it is not installed, nothing runs.
"""

import json
import os
import socket
import sys
import time

import tensorflow as tf

BATCH, WORDS, VOCAB, WIDTH, WARMUP = 32, 3, 8, 16384, 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def create_in_process_cluster(num_workers: int, num_ps: int) -> tf.distribute.cluster_resolver.ClusterResolver:
    """The tutorial's: TF servers in this process, one per task."""
    cluster = tf.train.ClusterSpec({"worker": [f"localhost:{free_port()}" for _ in range(num_workers)],
                                    "ps": [f"localhost:{free_port()}" for _ in range(num_ps)]})  # fmt: skip
    config = tf.compat.v1.ConfigProto()
    if (os.cpu_count() or 1) < num_workers + 1:
        config.inter_op_parallelism_threads = num_workers + 1
    for i in range(num_workers):
        tf.distribute.Server(cluster, job_name="worker", task_index=i, config=config, protocol="grpc")
    for i in range(num_ps):
        tf.distribute.Server(cluster, job_name="ps", task_index=i, protocol="grpc")
    return tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")


def dataset_fn(_):
    words = tf.random.stateless_uniform((BATCH * 1000, VOCAB - 1), seed=(0, 0))
    ids = tf.argsort(words, axis=1)[:, :WORDS] + 1
    labels = tf.cast(tf.reduce_all(ids != 1, axis=1), tf.float32)
    return tf.data.Dataset.from_tensor_slices((ids, labels)).shuffle(200).batch(BATCH).repeat()


def main() -> None:
    steps = int(sys.argv[1])
    os.environ["GRPC_FAIL_FAST"] = "use_caller"
    strategy = tf.distribute.ParameterServerStrategy(create_in_process_cluster(2, 2))
    with strategy.scope():
        inputs = tf.keras.layers.Input(shape=(WORDS,), dtype=tf.int32)
        hidden = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(VOCAB, WIDTH)(inputs))  # the mean over the words
        model = tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(hidden))
        optimizer = tf.keras.optimizers.Adagrad(learning_rate=0.001)

    @tf.function
    def step_fn(iterator):
        def replica_fn(ids, labels):
            with tf.GradientTape() as tape:
                pred = tf.squeeze(model(ids, training=True), 1)
                loss = tf.reduce_mean(tf.keras.losses.binary_crossentropy(labels[:, None], pred[:, None]))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss

        ids, labels = next(iterator)
        return strategy.run(replica_fn, args=(ids, labels))

    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(lambda: strategy.distribute_datasets_from_function(dataset_fn)))
    for _ in range(WARMUP):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    start = time.perf_counter()
    for _ in range(steps):
        coordinator.schedule(step_fn, args=(iterator,))
    coordinator.join()
    seconds = time.perf_counter() - start
    print(json.dumps({"samples_per_sec": steps * BATCH / seconds, "tensorflow": tf.__version__}))


if __name__ == "__main__":
    main()
