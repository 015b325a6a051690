"""Shared-memory buffers that process workers build batches in, handed to the training loop as is.

A batch a ``DataLoader`` worker returns crosses into the training process through a new
shared-memory file each time: ``default_collate`` creates and fills it in the worker, its
descriptor is sent over a socket, mapped and faulted in here, unmapped once dropped (1.3 ms
per 1.5 MB batch, and 3 ms of the worker's collation). Here a few buffers are made once, before
the workers start, and each task names the buffer its batch goes into: ``default_collate``
stacks the samples straight into it (another collate's output is copied in), and the training
loop gets tensors that are views of that buffer. A buffer is given to a new task only once
nothing in this process holds its memory any more (no tensor, view or NumPy array of the
batch), so a batch the loop still holds is never overwritten. Tasks that find every buffer
held, and tensors that do not fit, travel the usual way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.data import default_collate

from loom import compat

ALIGN = 64  # bytes: each tensor of a batch starts on a cache line
BUDGET = 1 << 30  # bytes of shared memory a loader's buffers take in all: torch commits a buffer's whole size
CAPACITY = 64 << 20  # bytes a buffer holds at most


@dataclass(frozen=True)
class InBuffer:
    """Where a tensor of a batch lies in its buffer (what travels instead of the tensor)."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class BatchBuffers:
    """``count`` buffers shared with the workers; made in the training process before they start.

    torch allocates a shared buffer's whole size at once (so that a full ``/dev/shm`` fails here,
    not as a bus error in a worker), so the buffers share a budget: with the 30 of two process
    workers' default prefetch each holds 34 MiB, and a larger batch travels the usual way.
    """

    def __init__(self, count: int, capacity: int | None = None) -> None:
        self.capacity = capacity if capacity is not None else min(CAPACITY, BUDGET // max(count, 1) // ALIGN * ALIGN)
        self.storages = [torch.UntypedStorage._new_shared(self.capacity) for _ in range(count)]
        self.in_flight: set[int] = set()  # given to a task, its batch not handed out yet

    def claim(self) -> int | None:
        """A buffer for the next task: one nothing here holds (only this object), or None."""
        for index, storage in enumerate(self.storages):
            if index not in self.in_flight and compat.storage_use_count(storage) == 1:
                self.in_flight.add(index)
                return index
        return None

    def release_all(self) -> None:
        """Forget every task in flight: the workers' earlier iteration is over, its results discarded."""
        self.in_flight.clear()

    def collate(self, index: int, collate_fn: Callable[[list[Any]], Any], values: list[Any]) -> Any:
        """In a worker: ``collate_fn(values)`` with its tensors in buffer ``index``, each replaced
        by an ``InBuffer``; tensors that do not fit stay as they are."""
        space = _Space(self, index)
        data = compat.collate_stacking(values, space.stack) if collate_fn is default_collate else collate_fn(values)
        return _replace(data, space.place)

    def read(self, index: int, data: Any) -> Any:
        """Here: the batch with views of buffer ``index`` for its ``InBuffer``s; the buffer is
        reusable once they are all gone (at once if the task's batch failed or travelled apart)."""
        self.in_flight.discard(index)
        return _replace(data, lambda place: self.view(index, place), InBuffer)

    def view(self, index: int, place: InBuffer) -> torch.Tensor:
        size = place.dtype.itemsize
        return torch.empty(0, dtype=place.dtype).set_(self.storages[index], place.offset // size, place.shape)


class _Space:
    """One task's use of its buffer: tensors laid one after another, each on a cache line."""

    def __init__(self, buffers: BatchBuffers, index: int) -> None:
        self.buffers = buffers
        self.index = index
        self.start = buffers.storages[index].data_ptr()
        self.end = 0

    def take(self, tensor: torch.Tensor, shape: tuple[int, ...]) -> InBuffer | None:
        """Room for a tensor of ``tensor``'s type and ``shape``, or None (full, or not a CPU tensor)."""
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            return None
        offset = -(-self.end // ALIGN) * ALIGN
        end = offset + math.prod(shape) * tensor.element_size()
        if end > self.buffers.capacity:
            return None
        self.end = end
        return InBuffer(offset, tensor.dtype, shape)

    def stack(self, batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
        """``default_collate``'s stacking of tensors, into the buffer where they fit. Samples of
        mixed dtypes, or that require grad, are stacked apart: ``out=`` would neither promote
        their types (int then float fails, float32 then float64 is cut to float32) nor take grads."""
        if any(t.dtype != batch[0].dtype or t.requires_grad for t in batch):
            return default_collate(batch)
        place = self.take(batch[0], (len(batch), *batch[0].shape))
        if place is None:
            return default_collate(batch)
        return torch.stack(batch, out=self.buffers.view(self.index, place))

    def place(self, tensor: torch.Tensor) -> torch.Tensor | InBuffer:
        """Where ``tensor`` lies in the buffer, copied in first unless stacked there."""
        if tensor.untyped_storage().data_ptr() == self.start and tensor.is_contiguous():
            return InBuffer(tensor.data_ptr() - self.start, tensor.dtype, tuple(tensor.shape))
        place = self.take(tensor, tuple(tensor.shape))
        if place is None:
            return tensor
        self.buffers.view(self.index, place).copy_(tensor)
        return place


def _replace(data: Any, fn: Any, kind: type = torch.Tensor) -> Any:
    """``data`` with each leaf of type ``kind`` replaced by ``fn(leaf)``."""
    if isinstance(data, kind):
        return fn(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a named tuple
        return type(data)(*(_replace(item, fn, kind) for item in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_replace(item, fn, kind) for item in data)
    if isinstance(data, dict):
        return type(data)((key, _replace(item, fn, kind)) for key, item in data.items())
    return data
