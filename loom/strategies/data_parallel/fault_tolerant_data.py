"""The input of a fault-tolerant job: each global batch split among the groups alive for its step.

Global batch ``d`` of the job is the d-th batch of the epoch order (``loom.data.sharding``), the
same on every group. Its samples are cut into ``count`` contiguous group slices (in units of the
group's N processes, as even as possible), then each group slice into N equal process slices.
Which batch comes next is the number of steps the job has committed, which a healed group takes
over with the weights: so no batch is skipped, and none is trained twice.

Iterated without gradients (``loom.evaluate``, ``fit``'s validation, ``predict``), the loader
takes no quorum: each group reads every batch (a last, partial one too), split among its own processes, so a group's
evaluation covers the whole data set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate

from loom.data.loader import to_device
from loom.data.sharding import check_global_batch, epoch_order
from loom.errors import LaunchError

if TYPE_CHECKING:
    from loom.strategies.data_parallel.fault_tolerant import FaultTolerantMirroredStrategy


def group_slice(batch_size: int, group_size: int, rank: int, count: int) -> tuple[int, int]:
    """Samples ``start, stop`` of a global batch that participating group ``rank`` of ``count`` trains.

    The batch is cut in units of ``group_size`` samples (one per process), spread as evenly as
    ``count`` allows: the first ``units % count`` groups take one unit more.
    """
    units = batch_size // group_size
    if units < count:
        raise ValueError(f"a global batch of {batch_size} cannot give {count} groups of {group_size} processes a sample each")
    base, extra = divmod(units, count)
    start = rank * base + min(rank, extra)
    return start * group_size, (start + base + (rank < extra)) * group_size


class GroupLoader:
    """This process's part of every global batch; one ``iter()`` is one epoch of the job.

    An epoch that the job has already trained (a restarted group catching up) yields nothing.
    """

    def __init__(
        self,
        strategy: FaultTolerantMirroredStrategy,
        data: Dataset,
        batch_size: int | None,
        shuffle: bool | None = None,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        if batch_size is None:
            raise ValueError("distribute() needs batch_size= (the global batch, split over the groups alive at each step)")
        if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise TypeError(f"under --groups, distribute() takes a map-style Dataset (with len and indexing), not {type(data).__name__}")
        check_global_batch(batch_size, strategy.group_size * strategy.groups)
        self.strategy = strategy
        self.dataset = data
        self.global_batch = batch_size
        self.shuffle = True if shuffle is None else shuffle
        self.seed = seed
        self.collate_fn = collate_fn or default_collate
        self.epoch = 0
        self._started = False
        self._evaluating = False
        self._valid = 0  # real samples of the batch last handed out in evaluation (a last one is padded)

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.global_batch)

    @property
    def steps_per_epoch(self) -> int:
        return len(self)

    @property
    def device(self) -> torch.device:
        return self.strategy.device

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._started = epoch, False

    def valid_count(self, batch: int) -> int:
        """Real samples this process trained (or evaluated) in the last batch handed out (a training batch is never padded)."""
        if self._evaluating:
            return self._valid
        return self.strategy.membership.samples // self.strategy.group_size

    def state_dict(self) -> dict[str, int]:
        """The job's position, in the format of every loom loader: a checkpoint resumes under any strategy."""
        batch = self.strategy.committed_batches() - self.epoch * len(self)
        return {"epoch": self.epoch, "batch": batch, "global_batch": self.global_batch, "samples": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume the job at that position: every group restores it before its first batch (a group that
        healed takes the live position instead)."""
        if state.get("samples", len(self.dataset)) != len(self.dataset) or state.get("global_batch", self.global_batch) != self.global_batch:
            raise ValueError(
                f"the saved input position is for {state.get('samples')} samples in global batches of {state.get('global_batch')}; "
                f"this data has {len(self.dataset)} in batches of {self.global_batch}: resume with the same data and global batch size"
            )
        epoch, batch = int(state["epoch"]), int(state["batch"])  # a checkpoint's: checked before the job's position moves
        if epoch < 0 or not 0 <= batch <= len(self):
            raise ValueError(f"the saved input position (epoch {epoch}, batch {batch}) is outside this data's {len(self)} batches an epoch")
        self.epoch, self._started = epoch, False
        self.strategy._resume_at(epoch * len(self) + batch)

    def __iter__(self) -> Iterator[Any]:
        if not torch.is_grad_enabled():  # evaluation: no step follows, so no quorum decides the data
            yield from self._evaluation()
            return
        if len(self.dataset) % self.global_batch:
            raise ValueError(
                f"under --groups every step trains a whole global batch, but {len(self.dataset)} samples leave a last batch of "
                f"{len(self.dataset) % self.global_batch}: train on a multiple of batch_size={self.global_batch} samples "
                "(evaluation takes any number)"
            )
        self.strategy._global_batch = self.global_batch  # the training loader's: its steps split and weigh this batch
        if self._started:
            self.epoch += 1
        self._started = True
        first = self.epoch * len(self)
        order = epoch_order(len(self.dataset), self.shuffle, self.seed, self.epoch)
        while True:
            batch = self.strategy._next_batch(end=first + len(self))
            if batch is None:
                return
            if batch < first:  # this group restored a later epoch than the live groups it healed from
                raise LaunchError(
                    f"group {self.strategy.group} restored the data at epoch {self.epoch}, but the groups it healed from are at "
                    f"global batch {batch} (epoch {batch // len(self)}): every group must restore the same checkpoint"
                )
            start, stop = self.strategy._process_slice()
            members = order[(batch - first) * self.global_batch :][start:stop].tolist()
            yield to_device(self.collate_fn([self.dataset[i] for i in members]), self.strategy.device)

    def _evaluation(self) -> Iterator[Any]:
        """Every global batch in the epoch's order, split among this group's processes only; a last, partial
        batch is padded with the epoch's last sample, which ``valid_count`` leaves out."""
        each, rank, total = self.global_batch // self.strategy.group_size, self.strategy.cluster.rank, len(self.dataset)
        order = epoch_order(total, self.shuffle, self.seed, self.epoch).tolist()
        self._evaluating = True
        try:
            for batch in range(len(self)):
                start = batch * self.global_batch + rank * each
                self._valid = max(0, min(each, total - start))
                members = [order[min(i, total - 1)] for i in range(start, start + each)]
                yield to_device(self.collate_fn([self.dataset[i] for i in members]), self.strategy.device)
        finally:
            self._evaluating = False
