"""TensorFlow's "Distributed training with Keras" tutorial, ported to loom.

https://www.tensorflow.org/tutorials/distribute/keras: MirroredStrategy, the global batch
from ``num_replicas_in_sync``, the model built under ``strategy.scope()``, ``fit`` with the
TensorBoard, ModelCheckpoint and LearningRateScheduler callbacks and one that prints the
learning rate, then the latest checkpoint restored and evaluated. MNIST becomes
scikit-learn's digits (nothing to download).

    python examples/tf_keras_fit.py           # 2 replicas on this machine
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.nn.functional as F

import loom
from loom.train import Callback, LearningRateScheduler, ModelCheckpoint
from mirrored_digits import DigitsCNN, digits

EPOCHS = int(os.environ.get("TF_EXAMPLE_EPOCHS", "12"))
BATCH_SIZE_PER_REPLICA = 64


def decay(epoch: int, lr: float) -> float:
    """The tutorial's schedule (its rates x2: Adam's 1e-3 is slow on 1,437 digits)."""
    return 2e-3 if epoch < 3 else 2e-4 if epoch < 7 else 2e-5


class PrintLR(Callback):
    def on_epoch_end(self, state, logs):
        state.strategy.print(f"Learning rate for epoch {state.epoch + 1} is {state.optimizer.param_groups[0]['lr']}")


def main() -> None:
    strategy = loom.MirroredStrategy()
    strategy.print(f"Number of devices: {strategy.num_replicas_in_sync}")
    batch_size = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    train, test = digits()
    with strategy.scope():
        torch.manual_seed(0)
        model = DigitsCNN()
    checkpoint_dir = os.environ["TF_EXAMPLE_DIR"]
    loom.fit(model, F.cross_entropy, lambda p: torch.optim.Adam(p, lr=2e-3), train, epochs=EPOCHS, batch_size=batch_size,
             strategy=strategy, metrics=["accuracy"], log_dir=os.path.join(checkpoint_dir, "logs"), progress=False,
             callbacks=[ModelCheckpoint(checkpoint_dir, monitor="loss"), LearningRateScheduler(decay), PrintLR()])  # fmt: skip
    strategy.restore(checkpoint_dir, model=model)  # the latest checkpoint, as tf.train.latest_checkpoint
    result = loom.evaluate(model, F.cross_entropy, test, batch_size=batch_size, strategy=strategy, metrics=["accuracy"])
    strategy.print(f"Eval loss: {result['loss']:.4f}, Eval accuracy: {result['accuracy']:.4f}")


if __name__ == "__main__":
    if "TF_EXAMPLE_DIR" not in os.environ:  # one folder for every replica (the workers inherit it)
        os.environ["TF_EXAMPLE_DIR"] = tempfile.mkdtemp(prefix="training_checkpoints")
    loom.launch(main, nproc=2)
