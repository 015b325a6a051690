"""The workloads of bench/workloads.py in TensorFlow MultiWorkerMirroredStrategy, one worker per process.

    TF_CONFIG=... .venv-tf/bin/python bench/peers/tf_peer.py WORKLOAD STEPS OUT

The same layers as the torch models (Keras builds them channels-last, its default on CPU), SGD
with momentum, cross-entropy, the same global batch, one intra-op thread per worker (``TF_THREADS`` for more), trained
by a custom loop (``strategy.run`` in a ``tf.function``), as TensorFlow's distributed-training
guide shows. The chief writes samples/s over
STEPS timed steps (after a warm-up epoch of 3) to OUT.
"""

import json
import os
import sys
import time

import tensorflow as tf

WARMUP = 3
SHAPES = {"W1": ((784,), 512), "W2": ((32, 32, 3), 256)}


def build(name: str) -> tf.keras.Model:
    layers = tf.keras.layers
    if name == "W1":
        body = [layers.Dense(2048, activation="relu"), layers.Dense(2048, activation="relu"), layers.Dense(2048, activation="relu")]
    else:
        body = [layers.Conv2D(32, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
                layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
                layers.Flatten(), layers.Dense(256, activation="relu")]  # fmt: skip
    return tf.keras.Sequential([tf.keras.Input(SHAPES[name][0]), *body, layers.Dense(10)])


def main() -> None:
    name, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    threads = int(os.environ.get("TF_THREADS", "1"))  # intra-op threads a worker, as loom gives each process
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    shape, global_batch = SHAPES[name]
    x = tf.random.normal((4 * global_batch, *shape), seed=0)
    y = tf.random.uniform((4 * global_batch,), maxval=10, dtype=tf.int32, seed=0)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(global_batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    batches = iter(strategy.experimental_distribute_dataset(data.with_options(options)))  # each worker its half
    with strategy.scope():
        model = build(name)
        optimizer = tf.keras.optimizers.SGD(0.01, momentum=0.9)
    losses = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def replica_step(features: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(losses(labels, model(features, training=True)), global_batch_size=global_batch)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    @tf.function
    def train_step() -> tf.Tensor:
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_step, args=next(batches)), axis=None)

    for _ in range(WARMUP):
        train_step().numpy()
    start = time.perf_counter()
    for _ in range(steps):
        loss = train_step()
    loss.numpy()  # the last step's all-reduce has finished on this worker
    rate = steps * global_batch / (time.perf_counter() - start)
    if strategy.cluster_resolver.task_id == 0:
        with open(out, "w") as f:
            json.dump({"peer": "tensorflow", "workload": name, "samples_per_sec": rate, "tensorflow": tf.__version__}, f)


if __name__ == "__main__":
    main()
