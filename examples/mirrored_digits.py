"""Train a small CNN on scikit-learn's handwritten digits with MirroredStrategy on 2 processes.

On a machine with one GPU it runs one process on it (two processes cannot share a GPU).

    python examples/mirrored_digits.py            # what `make demo` runs
    loom run --nproc 4 examples/mirrored_digits.py

The digits (1,797 8x8 images) ship inside scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import loom
from loom.devices import cuda_count

LOG_DIR = os.environ.get("LOOM_LOG_DIR", "runs/digits")


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """80/20 train/test split, pixels scaled to [0, 1]."""
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    split = int(0.8 * len(x))
    train, test = order[:split], order[split:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def main() -> None:
    torch.manual_seed(0)
    strategy = loom.MirroredStrategy()
    train, test = digits()
    history = loom.fit(
        DigitsCNN(),
        F.cross_entropy,
        lambda params: torch.optim.Adam(params, lr=2e-3),
        train,
        epochs=12,
        batch_size=64,
        strategy=strategy,
        val_data=test,
        metrics=["accuracy"],
        log_dir=LOG_DIR,
    )
    if strategy.is_chief:  # val_* is computed over the whole test set, each image once
        print(f"TensorBoard logs: {LOG_DIR}  (tensorboard --logdir {LOG_DIR})")
        print(f"test accuracy: {history['val_accuracy'][-1]:.2f}")


if __name__ == "__main__":
    loom.launch(main, nproc=min(2, cuda_count() or 2))
