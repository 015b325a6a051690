"""The benchmark workloads and helpers to time them and save results (JSON and PNG)."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

if TYPE_CHECKING:  # the peers' environments (bench/peers) have torch but not loom
    import loom

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


def endless(batches: Iterable) -> Iterator:
    """Epoch after epoch of ``batches``, so a benchmark never runs out of data."""
    while True:
        yield from batches


def sgd_step(model: nn.Module, opt: torch.optim.Optimizer, batches: Iterator, backward: Callable) -> Callable[[], None]:
    """One benchmark training step: next batch, cross-entropy, ``backward(loss)``, update."""

    def step() -> None:
        x, y = next(batches)
        backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()

    return step


def loom_step(strategy: loom.Strategy, workload: Workload, data: TensorDataset) -> Callable[[], None]:
    """A training step of ``workload`` under ``strategy``, written as a user would."""
    torch.manual_seed(0)
    model, opt = strategy.prepare(workload.build(), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    return sgd_step(model, opt, endless(strategy.distribute(data, batch_size=workload.global_batch)), strategy.backward)


def timed(step: Callable[[], None], steps: int, sync: Callable[[], None] = dist.barrier) -> float:
    """Seconds for ``steps`` steps, between two synchronisations of every replica."""
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return time.perf_counter() - start


def machine() -> dict[str, str | int]:
    """What a figure was measured on: the CPU's model and whether it has AMX (bf16 matrix units)
    change convolution timings several-fold, and shared VMs move between hosts."""
    model, flags = platform.processor() or platform.machine(), ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        fields = dict(line.split(":", 1) for line in cpuinfo.read_text().splitlines() if ":" in line)
        model = fields.get("model name\t", model).strip()
        flags = " ".join(f for f in fields.get("flags\t\t", "").split() if f.startswith(("amx", "avx512_bf16")))
    return {"torch": torch.__version__, "cpu": model, "bf16_units": flags or "none", "threads": torch.get_num_threads()}


def save(name: str, results: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({**results, "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=2))
    return path
