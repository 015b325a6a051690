"""``strategy.distribute``: a per-replica loader over a dataset, an iterable or a DataLoader."""

from __future__ import annotations

import itertools
import random
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.dataloader import default_collate

from loom.data.sharding import ReplicaBatchSampler, ShardPlan, buffer_shuffle, check_global_batch, epoch_seed


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(b, device, non_blocking) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


class DistributedLoader:
    """Iterates this replica's batches; every ``iter()`` is a new epoch, reshuffled.

    ``len()`` is the number of steps per epoch, the same on every replica.
    """

    def __init__(
        self,
        data: Dataset | DataLoader | Iterable,
        batch_size: int | None,
        num_replicas: int,
        replica: int,
        device: torch.device,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int | None = None,
        collate_fn: Callable | None = None,
    ) -> None:
        loader_args: dict[str, Any] = {}
        if isinstance(data, DataLoader):
            # A DataLoader's batch_size is taken as the global batch (as tf.distribute does).
            batch_size = batch_size or data.batch_size
            collate_fn = collate_fn or data.collate_fn
            num_workers = data.num_workers if num_workers is None else num_workers
            loader_args = {"worker_init_fn": data.worker_init_fn, "multiprocessing_context": data.multiprocessing_context}
            data = data.dataset
        if batch_size is None:
            raise ValueError("distribute() needs batch_size= (the global batch, split over the replicas)")
        self.per_replica_batch = check_global_batch(batch_size, num_replicas)
        self.global_batch = batch_size
        self.num_replicas = num_replicas
        self.replica = replica
        self.device = device
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate_fn = collate_fn or default_collate
        self.epoch = 0
        self._started = False
        self.position = 0  # batches of the current epoch handed out
        self._start = 0  # where the current iteration began
        self._resume_at: int | None = None  # batch of ``epoch`` to continue from, after load_state_dict
        self.dataset = data
        self.plan: ShardPlan | None = None
        self._iterable_tail: tuple[int, int] | None = None  # (batch, real samples here) of an uneven last batch
        self._loader: DataLoader | None = None
        if not isinstance(data, IterableDataset) and hasattr(data, "__getitem__") and hasattr(data, "__len__"):
            self.plan = ShardPlan(len(data), batch_size, num_replicas, drop_last)
            self._sampler = ReplicaBatchSampler(self.plan, replica, shuffle, seed)
            workers = num_workers or 0
            self._loader = DataLoader(
                data,
                batch_sampler=self._sampler,
                collate_fn=self.collate_fn,
                num_workers=workers,
                pin_memory=device.type == "cuda",
                persistent_workers=workers > 0,
                generator=own_generator(seed),
                **loader_args,
            )
        elif not isinstance(data, Iterable):
            raise TypeError(
                f"distribute() takes a torch Dataset, an iterable or a DataLoader, not {type(data).__name__}"
            )

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next ``iter()`` yields (for resuming)."""
        if epoch != self.epoch:
            self._resume_at = None
        self.epoch = epoch
        self._started = False

    def state_dict(self) -> dict[str, int]:
        """The position: the epoch and how many of its batches were handed out."""
        return {"epoch": self.epoch, "batch": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The next ``iter()`` continues that epoch with exactly the next batch."""
        self.epoch, self._resume_at = state["epoch"], state["batch"]
        self._started = False

    @property
    def steps_per_epoch(self) -> int | None:
        """Steps per epoch on every replica; None for an iterable dataset (unknown until read)."""
        return len(self.plan) if self.plan is not None else None

    def __len__(self) -> int:
        if self.plan is None:
            raise TypeError("an iterable dataset has no length; iterate it to the end instead")
        return len(self.plan)

    def valid_count(self, batch: int) -> int:
        """Real (non-padding) samples in this replica's slice of global batch ``batch``."""
        batch += self._start
        if self.plan is None:
            tail_batch, tail_count = self._iterable_tail or (-1, 0)
            return tail_count if batch == tail_batch else self.per_replica_batch
        return self.plan.valid_count(batch, self.replica)

    def __iter__(self) -> Iterator[Any]:
        if self._started:  # a second pass without set_epoch is the next epoch
            self.epoch += 1
        self._started = True
        self._start, self._resume_at = self._resume_at or 0, None
        self.position = self._start
        non_blocking = self.device.type == "cuda"
        if self._loader is not None:
            self._sampler.set_epoch(self.epoch, start=self._start)
            batches: Iterable[Any] = self._loader
        else:
            batches = itertools.islice(self._iterable_batches(), self._start, None)
        for batch in batches:
            self.position += 1
            yield to_device(batch, self.device, non_blocking)

    def _iterable_batches(self) -> Iterator[Any]:
        """Every replica reads the whole stream and keeps its slice of each global batch.

        Simple and exact for any iterable; the input pipeline shards by file instead.
        With ``shuffle``, a seeded buffer of 16 global batches reorders the stream.
        """
        self._iterable_tail = None
        stream: Iterable[Any] = self.dataset
        if self.shuffle:
            stream = buffer_shuffle(stream, 16 * self.global_batch, random.Random(epoch_seed(self.seed, self.epoch)))
        mine = slice(self.replica * self.per_replica_batch, (self.replica + 1) * self.per_replica_batch)
        chunk: list[Any] = []
        batch = 0
        for sample in stream:
            chunk.append(sample)
            if len(chunk) == self.global_batch:
                yield self.collate_fn(chunk[mine])
                chunk, batch = [], batch + 1
        if chunk and not self.drop_last:
            yield self.collate_fn(self._take_tail(chunk, batch))

    def _take_tail(self, chunk: list[Any], batch: int) -> list[Any]:
        """This replica's slice of the stream's uneven last batch (the same padding rule)."""
        plan = ShardPlan(len(chunk), self.global_batch, self.num_replicas)
        self._iterable_tail = (batch, plan.valid_count(0, self.replica))
        return plan.slice_of_batch(chunk, 0, self.replica)


def own_generator(seed: int) -> torch.Generator:
    """A DataLoader draws a seed for its workers at every epoch; from its own generator that
    draw leaves the global RNG alone, so training (dropout...) resumes exactly from a checkpoint."""
    return torch.Generator().manual_seed(seed)
