"""TensorFlow's "Use TPUs" guide, ported to loom.

https://www.tensorflow.org/guide/tpu: ``TPUStrategy``, the global batch as the per-replica
batch times ``num_replicas_in_sync`` (8 on a TPU v3-8), the model made under
``strategy.scope()``, Keras ``fit`` with ``steps_per_epoch`` and ``validation_steps``, then
evaluation. One process drives every device; each step is one ``jax.jit`` program. MNIST
becomes scikit-learn's digits (nothing to download).

Where there is no TPU it makes 8 virtual XLA CPU devices, as the tests do:

    python examples/tf_tpu.py                 # needs pip install 'loom[xla]'
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts: 8 devices on a CPU

import torch
import torch.nn.functional as F
from torch import nn

import loom
from mirrored_digits import digits

EPOCHS = int(os.environ.get("TF_EXAMPLE_EPOCHS", "5"))
PER_REPLICA_BATCH = 16


def create_model() -> nn.Module:
    """The guide's model, smaller: a convolution, then two dense layers."""
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10))


def main() -> None:
    strategy = loom.TPUStrategy()
    print(f"All devices: {strategy.num_replicas_in_sync} replicas on {strategy.num_hosts} host(s)")
    batch_size = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    train, test = digits()
    steps_per_epoch = len(train) // batch_size
    validation_steps = len(test) // batch_size
    with strategy.scope():
        torch.manual_seed(0)
        model = create_model()
    history = loom.fit(model, F.cross_entropy, lambda p: torch.optim.Adam(p, lr=2e-3), train, epochs=EPOCHS, batch_size=batch_size,
                       steps_per_epoch=steps_per_epoch, val_data=test, validation_steps=validation_steps, strategy=strategy,
                       metrics=["accuracy"], progress=False)  # fmt: skip
    print(f"TPUStrategy, {strategy.num_replicas_in_sync} replicas: test accuracy: {history['val_accuracy'][-1]:.4f}")


if __name__ == "__main__":
    main()
