"""Random numbers while reading data: every batch drawn from its own seed (seed, replica, epoch, batch).

A DataLoader seeds its workers from one generator that is the same on every replica, so every
replica would apply the same random crops and flips, and a resumed run's fresh workers would
draw epoch 0's numbers again. Instead each batch is read and collated with torch's (CPU),
NumPy's and Python's global generators seeded from its place in the run: different on every
replica and epoch, independent of the number of workers and of which worker reads it, and the
same after a resume. The generators are restored afterwards, so with ``num_workers=0`` the
training process's own random state (dropout...) is untouched, and in a worker what the user's
``worker_init_fn`` set up stays in place between batches.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

_U64 = 2**64


class Batch(list):
    """A batch of indices, with the seed its samples are read with."""

    def __init__(self, indices: Iterable[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed


def mix(*words: int) -> int:
    """A 63-bit seed mixed from several numbers (NumPy's SeedSequence): e.g. seed, replica, epoch, batch."""
    entropy = [w % _U64 for w in words]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]) >> 1


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch (CPU), NumPy and Python ``random`` seeded from ``seed`` inside, restored after."""
    torch_state, numpy_state, python_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    seed %= _U64
    torch.default_generator.manual_seed(seed >> 1)  # CPU only: a CUDA generator is the trainer's
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
    random.seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(python_state)


class Collated:
    """A collated batch on its way through the DataLoader's fetcher (see ``SeededReader``)."""

    def __init__(self, data: Any) -> None:
        self.data = data


def unwrap(collated: Collated) -> Any:
    """The DataLoader's ``collate_fn`` behind a ``SeededReader``: collation already happened."""
    return collated.data


class SeededReader(Dataset):
    """The user's dataset, each batch read and collated under its ``Batch.seed``.

    Collation runs here, inside the seed (mixup in a ``collate_fn`` draws random numbers too);
    the DataLoader's own ``collate_fn`` is then ``unwrap``.
    """

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: Batch) -> Collated:
        with seeded(batch.seed):
            read_many = getattr(self.dataset, "__getitems__", None)
            samples = read_many(list(batch)) if read_many else [self.dataset[i] for i in batch]
            return Collated(self.collate_fn(samples))
