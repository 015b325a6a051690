"""TensorFlow's "Multi-worker training with Keras" tutorial, ported to loom.

https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras: each worker reads
the cluster from ``TF_CONFIG``, builds ``MultiWorkerMirroredStrategy``, makes the global
batch from the per-worker batch and ``num_replicas_in_sync``, builds the model under
``strategy.scope()`` and runs ``fit(epochs=3, steps_per_epoch=70)`` over data repeated as
needed, with ``BackupAndRestore`` (here ``checkpoint_dir=``) so a restarted worker resumes.
MNIST becomes scikit-learn's digits (nothing to download), and the tutorial's SGD(0.001)
Adam(0.002), which learns them in a few steps.

On each worker, with its own task index (two workers may share one machine):

    export TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:23456"]}, "task": {"type": "worker", "index": 0}}'
    loom run examples/tf_multi_worker.py
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.nn.functional as F

import loom
from mirrored_digits import DigitsCNN, digits

EPOCHS = int(os.environ.get("TF_EXAMPLE_EPOCHS", "3"))
STEPS_PER_EPOCH = int(os.environ.get("TF_EXAMPLE_STEPS", "70"))
PER_WORKER_BATCH_SIZE = 64


def main() -> None:
    strategy = loom.MultiWorkerMirroredStrategy()
    global_batch_size = PER_WORKER_BATCH_SIZE * strategy.num_replicas_in_sync
    train, test = digits()
    with strategy.scope():
        torch.manual_seed(0)
        model = DigitsCNN()
    backup_dir = os.environ.get("TF_EXAMPLE_DIR") or os.path.join(tempfile.gettempdir(), "loom_multi_worker_backup")
    history = loom.fit(model, F.cross_entropy, lambda p: torch.optim.Adam(p, lr=2e-3), train, epochs=EPOCHS,
                       steps_per_epoch=STEPS_PER_EPOCH, batch_size=global_batch_size, strategy=strategy, val_data=test,
                       metrics=["accuracy"], checkpoint_dir=backup_dir, progress=False)  # fmt: skip
    strategy.barrier()
    if strategy.is_chief:  # as Keras' BackupAndRestore, the backup goes once training has finished
        shutil.rmtree(backup_dir)
    strategy.print(f"{strategy.num_replicas_in_sync} workers: loss {history['loss'][-1]:.4f}, test accuracy: {history['val_accuracy'][-1]:.4f}")


if __name__ == "__main__":
    loom.launch(main)
