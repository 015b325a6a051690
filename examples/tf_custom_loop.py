"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, ported to loom.

https://www.tensorflow.org/tutorials/distribute/custom_training: the datasets through
``experimental_distribute_dataset`` (a DataLoader's batch is the global batch), the model and
optimizer made under ``strategy.scope()``, the per-example loss scaled with
``compute_average_loss``, each step through ``strategy.run`` and the replicas' losses summed
with ``strategy.reduce(ReduceOp.SUM, ...)``, test loss and accuracy per epoch, and a
checkpoint. Fashion-MNIST becomes scikit-learn's digits (nothing to download).

loom averages the replicas' gradients (TF sums them): ``loom.compute_average_loss`` keeps
TF's call and gives the global batch's mean gradient; ``loss.mean()`` would too.

    python examples/tf_custom_loop.py         # 2 replicas on this machine
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import loom
from mirrored_digits import DigitsCNN, digits

EPOCHS = int(os.environ.get("TF_EXAMPLE_EPOCHS", "10"))
BATCH_SIZE_PER_REPLICA = 64


def main() -> None:
    strategy = loom.MirroredStrategy()
    strategy.print(f"Number of devices: {strategy.num_replicas_in_sync}")
    global_batch_size = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    train, test = digits()
    train_dist_dataset = strategy.experimental_distribute_dataset(DataLoader(train, batch_size=global_batch_size, shuffle=True))
    test_dist_dataset = strategy.experimental_distribute_dataset(DataLoader(test, batch_size=global_batch_size))

    with strategy.scope():
        torch.manual_seed(0)
        model, optimizer = strategy.prepare(DigitsCNN(), lambda p: torch.optim.Adam(p, lr=2e-3))

    def compute_loss(labels, predictions):
        per_example_loss = F.cross_entropy(predictions, labels, reduction="none")
        return loom.compute_average_loss(per_example_loss, global_batch_size, strategy=strategy)

    def train_step(inputs):
        images, labels = inputs
        predictions = model(images)
        loss = compute_loss(labels, predictions)
        strategy.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    @torch.no_grad()
    def test_step(inputs):
        images, labels = inputs
        predictions = model(images)
        return F.cross_entropy(predictions, labels, reduction="sum"), (predictions.argmax(1) == labels).sum(), torch.tensor(len(labels))

    checkpoint_dir = os.environ["TF_EXAMPLE_DIR"]
    for epoch in range(EPOCHS):
        total_loss, num_batches = 0.0, 0
        for x in train_dist_dataset:
            per_replica_losses = strategy.run(train_step, args=(x,))
            total_loss += float(strategy.reduce(loom.ReduceOp.SUM, per_replica_losses, axis=None))
            num_batches += 1
        model.eval()
        sums = torch.zeros(3)
        for x in test_dist_dataset:  # the test set splits evenly over 2 replicas: no padding to leave out
            sums += torch.stack([t.float().cpu() for t in strategy.run(test_step, args=(x,))])
        model.train()
        test_loss, correct, seen = strategy.reduce(loom.ReduceOp.SUM, sums, axis=None).tolist()
        if epoch % 2 == 0:
            strategy.save(checkpoint_dir, step=epoch, model=model, optimizer=optimizer)
        # the replicas' summed losses: TF's scaled loss, times the replica count that loom's scaling adds
        train_loss = total_loss / num_batches / strategy.num_replicas_in_sync
        strategy.print(f"Epoch {epoch + 1}, Loss: {train_loss:.4f}, Test Loss: {test_loss / seen:.4f}, Test Accuracy: {correct / seen:.4f}")


if __name__ == "__main__":
    if "TF_EXAMPLE_DIR" not in os.environ:  # one folder for every replica (the workers inherit it)
        os.environ["TF_EXAMPLE_DIR"] = tempfile.mkdtemp(prefix="training_checkpoints")
    loom.launch(main, nproc=2)
