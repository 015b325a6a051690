"""Which samples each replica reads, so N replicas see exactly 1 replica's global batches.

The global order of an epoch is fixed by the seed alone (a permutation of the dataset, or
dataset order without shuffling). Global batch k is positions ``k*B .. (k+1)*B-1`` of that
order and replica r takes the r-th contiguous slice of it. Averaging the replicas' mean
gradients then gives the mean gradient of the global batch, whatever the number of replicas.

Uneven last batch (``drop_last=False`` and ``len(data) % B != 0``): its m samples are split
into slices of ``ceil(m / N)``, the last slices padded by repeating the batch's first samples,
so every replica runs the same number of steps and no collective waits forever. The padded
samples are reported by ``valid_count`` so evaluation can leave them out; training on them
counts a few samples twice in the last step of the epoch (exact only when N divides m).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import random
from typing import Iterable, Iterator, TypeVar

import torch
from torch.utils.data import Sampler

T = TypeVar("T")


def check_global_batch(batch_size: int, num_replicas: int) -> int:
    """The per-replica batch; a clear error when the global batch does not split evenly."""
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer (the global batch), got {batch_size!r}")
    if batch_size % num_replicas:
        lower = batch_size - batch_size % num_replicas
        options = f"{lower} or {lower + num_replicas}" if lower else f"{num_replicas}"
        raise ValueError(
            f"global batch_size {batch_size} is not divisible by the {num_replicas} replicas in sync; "
            f"use a multiple of {num_replicas} (e.g. {options})"
        )
    return batch_size // num_replicas


def epoch_seed(seed: int, epoch: int) -> int:
    """One seed per (seed, epoch), so every epoch is shuffled differently and reproducibly."""
    return seed * 1_000_003 + epoch


def epoch_order(num_samples: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The global sample order of one epoch: identical on every replica and world size."""
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator).tolist()


@dataclass(frozen=True)
class ShardPlan:
    """How one epoch of ``num_samples`` splits into global batches and replica slices."""

    num_samples: int
    global_batch: int
    num_replicas: int
    drop_last: bool = False

    def __post_init__(self) -> None:
        check_global_batch(self.global_batch, self.num_replicas)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch
        return math.ceil(self.num_samples / self.global_batch)

    def batch_size_of(self, batch: int) -> int:
        """Real samples in global batch ``batch`` (less than the global batch only at the end)."""
        return min(self.global_batch, self.num_samples - batch * self.global_batch)

    def slice_size(self, batch: int) -> int:
        return math.ceil(self.batch_size_of(batch) / self.num_replicas)

    def replica_slice(self, order: list[int], batch: int, replica: int) -> list[int]:
        """Dataset indices that ``replica`` reads for global batch ``batch``."""
        start = batch * self.global_batch
        return self.slice_of_batch(order[start : start + self.batch_size_of(batch)], batch, replica)

    def slice_of_batch(self, members: list[T], batch: int, replica: int) -> list[T]:
        """``replica``'s part of global batch ``batch``, given that batch's members in order."""
        real, size = len(members), self.slice_size(batch)
        if real == size * self.num_replicas:  # every batch but an uneven last one
            return members[replica * size : (replica + 1) * size]
        padded = (members * math.ceil(size * self.num_replicas / real))[: size * self.num_replicas]
        return padded[replica * size : (replica + 1) * size]

    def valid_count(self, batch: int, replica: int) -> int:
        """How many of the replica's samples in ``batch`` are real rather than padding."""
        size = self.slice_size(batch)
        return max(0, min(size, self.batch_size_of(batch) - replica * size))


class ReplicaBatchSampler(Sampler[list[int]]):
    """A ``DataLoader`` batch sampler yielding one replica's slice of each global batch."""

    def __init__(self, plan: ShardPlan, replica: int, shuffle: bool, seed: int) -> None:
        self.plan = plan
        self.replica = replica
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The epoch to yield, from global batch ``start`` on (for resuming mid-epoch)."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[list[int]]:
        order = epoch_order(self.plan.num_samples, self.shuffle, self.seed, self.epoch)
        for batch in range(self.start, len(self.plan)):
            yield self.plan.replica_slice(order, batch, self.replica)


def buffer_shuffle(stream: Iterable[T], buffer_size: int, rng: random.Random) -> Iterator[T]:
    """tf.data's shuffle: a buffer of ``buffer_size`` items, one drawn at random as each arrives."""
    buffer: list[T] = []
    for item in stream:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        i = rng.randrange(buffer_size)
        yield buffer[i]
        buffer[i] = item
    rng.shuffle(buffer)
    yield from buffer
