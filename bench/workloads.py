"""The benchmark workloads and helpers to time them and save results (JSON and PNG)."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    global_batch: int
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    classes: int = 10

    def data(self, batches: int, seed: int = 0) -> TensorDataset:
        """``batches`` global batches of random inputs (the model's speed does not depend on values)."""
        g = torch.Generator().manual_seed(seed)
        n = batches * self.global_batch
        return TensorDataset(torch.randn(n, *self.input_shape, generator=g), torch.randint(0, self.classes, (n,), generator=g))


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
        nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10),
    )  # fmt: skip


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    )  # fmt: skip


# Not a training workload: a model so small that a step is all fixed cost, which isolates
# what loom's own Python adds per step.
TINY = Workload("tiny", "Linear 8->10, global batch 64", 64, lambda: nn.Linear(8, 10), (8,))

WORKLOADS = {
    "W1": Workload("W1", "MLP 784-2048-2048-2048-10, global batch 512", 512, mlp, (784,)),
    "W2": Workload("W2", "small CNN on 3x32x32, global batch 256", 256, small_cnn, (3, 32, 32)),
}


def machine() -> dict[str, str | int]:
    return {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}


def save(name: str, results: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({**results, "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    return path
