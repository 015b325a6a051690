"""``strategy.distribute``: a per-replica loader over a dataset, an iterable or a DataLoader."""

from __future__ import annotations

import functools
import itertools
import random
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler
from torch.utils.data.dataloader import default_collate

from loom.data.seeding import SeededReader, mix, unwrap
from loom.data.sharding import ReplicaBatchSampler, ShardPlan, buffer_shuffle, check_global_batch, epoch_seed
from loom.data.streams import TokenStreams
from loom.data.user_loader import read_dataloader, sampler_order


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

    Order guarantee: replica r gets the r-th contiguous slice of every global batch (see
    ``loom.data.sharding``); without shuffle, global batch k is samples ``k*B .. (k+1)*B-1``.
    Consecutive slices of a replica are not consecutive samples, except for the rows of
    ``loom.data.stream_batches``. ``len()`` is the number of steps per epoch, the same on
    every replica. Every batch is read with its own random seed (``loom.data.seeding``).
    """

    def __init__(
        self,
        data: Dataset | DataLoader | Iterable,
        batch_size: int | None,
        num_replicas: int,
        replica: int,
        device: torch.device,
        shuffle: bool | None = None,
        seed: int = 0,
        drop_last: bool | None = None,
        num_workers: int | None = None,
        collate_fn: Callable | None = None,
    ) -> None:
        loader_args: dict[str, Any] = {}
        sampler: Sampler | None = None  # a user's sampler, sharded; None: loom's order
        if isinstance(data, DataLoader):
            request = read_dataloader(data, batch_size, shuffle, drop_last, seed, num_workers, collate_fn)
            data, batch_size, seed = request.dataset, request.batch_size, request.seed
            shuffle, drop_last = request.shuffle, request.drop_last
            num_workers, collate_fn = request.num_workers, request.collate_fn
            sampler, loader_args = request.sampler, request.loader_args
        elif isinstance(data, TokenStreams):
            batch_size, shuffle = _stream_settings(data, batch_size, shuffle)
        if batch_size is None:
            raise ValueError("distribute() needs batch_size= (the global batch, split over the replicas)")
        self.per_replica_batch = check_global_batch(batch_size, num_replicas)
        self.global_batch = batch_size
        self.num_replicas = num_replicas
        self.replica = replica
        self.device = device
        self.shuffle = True if shuffle is None else shuffle
        self.seed = seed
        self.drop_last = bool(drop_last)
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
            order = None if sampler is None else functools.partial(sampler_order, sampler, seed)
            samples = len(data) if sampler is None else len(sampler)  # type: ignore[arg-type]
            self.plan = ShardPlan(samples, batch_size, num_replicas, self.drop_last)
            self._sampler = ReplicaBatchSampler(self.plan, replica, self.shuffle, seed, order)
            workers = num_workers or 0
            self._loader = DataLoader(
                SeededReader(data, self.collate_fn),
                batch_sampler=self._sampler,
                collate_fn=unwrap,
                num_workers=workers,
                pin_memory=device.type == "cuda",
                persistent_workers=workers > 0,
                generator=own_generator(mix(seed, replica)),
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

    def state_dict(self) -> dict[str, int | None]:
        """The position (the epoch, batches handed out) and what it counts: global batches of a data set's size."""
        return {
            "epoch": self.epoch,
            "batch": self.position,
            "global_batch": self.global_batch,
            "samples": self.plan.num_samples if self.plan is not None else None,
        }

    def load_state_dict(self, state: dict[str, int | None]) -> None:
        """The next ``iter()`` continues that epoch with exactly the next batch; a clear error where it cannot."""
        samples = self.plan.num_samples if self.plan is not None else None
        if state.get("samples", samples) != samples:
            raise ValueError(
                f"the saved input position is for {state['samples']} samples an epoch; this data has {samples}: "
                "it is not the same data"
            )
        if state.get("global_batch", self.global_batch) != self.global_batch:
            raise ValueError(
                f"the saved input position counts global batches of {state['global_batch']}; this run uses "
                f"{self.global_batch}: resume with the same global batch size"
            )
        self.epoch, self._resume_at = int(state["epoch"]), int(state["batch"])  # type: ignore[arg-type]
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


def _stream_settings(data: TokenStreams, batch_size: int | None, shuffle: bool | None) -> tuple[int, bool]:
    """Token streams keep their rows' order and their own batch: anything else breaks a row's state."""
    if batch_size is not None and batch_size != data.batch_size:
        raise ValueError(
            f"distribute(batch_size={batch_size}) differs from the stream_batches layout's {data.batch_size} rows; "
            "leave batch_size out, or lay the tokens out again with stream_batches(tokens, batch_size, seq_len)"
        )
    if shuffle:
        raise ValueError(
            "stream_batches data cannot be shuffled: row i of each batch continues row i of the last; "
            "leave shuffle out or pass shuffle=False"
        )
    return data.batch_size, False


def own_generator(seed: int) -> torch.Generator:
    """A DataLoader draws a seed for its workers at every epoch; from its own generator that
    draw leaves the global RNG alone, so training (dropout...) resumes exactly from a checkpoint."""
    return torch.Generator().manual_seed(seed)
