"""loom.fit under whatever strategy the launch implies; each rank saves its history."""

import json
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import loom


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] + x[:, 1] > 0).long())


def main() -> None:
    out, log_dir = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    strategy = loom.auto_strategy()
    history = loom.fit(
        nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)),
        F.cross_entropy,
        lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9),
        data(400, 0),
        val_data=data(101, 1),  # 101: the last validation batch is uneven and padded
        epochs=3,
        batch_size=40,
        metrics=["accuracy"],
        log_dir=log_dir,
        progress=True,
    )
    with open(f"{out}.{strategy.replica_id}.json", "w") as f:
        json.dump(history, f)


if __name__ == "__main__":
    loom.launch(main)
