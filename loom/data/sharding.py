"""Which samples each replica reads, so N replicas see exactly 1 replica's global batches.

The global order of an epoch is fixed by the seed alone (a permutation of the dataset, dataset
order without shuffling, or a user's sampler drawn with a seed shared by every replica). It is
an int32/int64 tensor, 4 or 8 bytes a sample, not a Python list. Global batch k is positions ``k*B .. (k+1)*B-1`` of that
order and replica r takes the r-th contiguous slice of it. Averaging the replicas' mean
gradients then gives the mean gradient of the global batch, whatever the number of replicas.

Order guarantee: replica r reads the r-th contiguous slice of every global batch, so with
``shuffle=False`` replica r always reads positions ``k*B + r*b .. k*B + (r+1)*b - 1`` of the
data at step k (b = B/N). Nothing links a replica's slices from one step to the next; for a
stream whose state carries over between steps (truncated BPTT) lay the data out with
``loom.data.stream_batches``, whose rows continue each other.

Uneven last batch (``drop_last=False`` and ``len(data) % B != 0``): its m samples are split
into slices of ``ceil(m / N)``, the last slices padded by repeating the batch's first samples,
so every replica runs the same number of steps and no collective waits forever. The padded
samples are reported by ``valid_count`` so evaluation and training metrics can leave them out;
training on them counts a few samples twice in the last step of the epoch (exact only when N
divides m). That last batch is the only one with padding.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import torch
from torch.utils.data import Sampler

from loom.data.seeding import Batch, mix

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


def index_dtype(num_samples: int) -> torch.dtype:
    """int32 while it can hold every index: an epoch's order costs 4 bytes a sample, not a Python int's 36."""
    return torch.int32 if num_samples < 2**31 else torch.int64


def epoch_order(num_samples: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """The global sample order of one epoch: identical on every replica and world size."""
    if not shuffle:
        return torch.arange(num_samples, dtype=index_dtype(num_samples))
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator, dtype=index_dtype(num_samples))


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

    def replica_slice(self, order: torch.Tensor | Sequence[int], batch: int, replica: int) -> list[int]:
        """Dataset indices that ``replica`` reads for global batch ``batch``."""
        start = batch * self.global_batch
        members = order[start : start + self.batch_size_of(batch)]
        members = members.tolist() if isinstance(members, torch.Tensor) else list(members)
        return self.slice_of_batch(members, batch, replica)

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
    """A ``DataLoader`` batch sampler yielding one replica's slice of each global batch.

    ``order(epoch)`` gives the epoch's global order (default: ``epoch_order`` of the plan's
    samples); it must be the same on every replica. Each batch is a ``loom.data.seeding.Batch``
    that carries the seed its samples are read with.
    """

    def __init__(
        self,
        plan: ShardPlan,
        replica: int,
        shuffle: bool,
        seed: int,
        order: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        self.plan = plan
        self.replica = replica
        self.shuffle = shuffle
        self.seed = seed
        self.order = order or (lambda epoch: epoch_order(plan.num_samples, shuffle, seed, epoch))
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The epoch to yield, from global batch ``start`` on (for resuming mid-epoch)."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        for batch in range(self.start, len(self.plan)):
            indices = self.plan.replica_slice(order, batch, self.replica)
            yield Batch(indices, mix(self.seed, self.replica, self.epoch, batch))


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
