"""Shared-memory buffers that process workers write batches into, handed to the training loop as is.

A batch a ``DataLoader`` worker returns crosses into the training process through a new
shared-memory file each time: created and filled in the worker, its descriptor sent over a
socket, mapped and faulted in here, unmapped once dropped (1.3 ms per 1.5 MB batch). Here a
few buffers are made once, before the workers start, and each task names the buffer its
batch goes into; the training loop gets tensors that are views of that buffer. A buffer is
given to a new task only once nothing in this process holds its memory any more (no tensor,
view or NumPy array of the batch), so a batch the loop still holds is never overwritten.
Tasks that find every buffer held, and batches too large for one, travel the usual way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loom import compat

ALIGN = 64  # bytes: each tensor of a batch starts on a cache line
CAPACITY = 256 << 20  # bytes a buffer can hold; shared memory takes only the pages a batch touches


@dataclass(frozen=True)
class InBuffer:
    """Where a tensor of a batch lies in its buffer (what travels instead of the tensor)."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class BatchBuffers:
    """``count`` buffers shared with the workers; made in the training process before they start."""

    def __init__(self, count: int, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self.storages = [torch.UntypedStorage._new_shared(capacity) for _ in range(count)]
        self.in_flight: set[int] = set()  # given to a task, its batch not handed out yet

    def claim(self) -> int | None:
        """A buffer for the next task: one nothing here holds (only this object), or None."""
        for index, storage in enumerate(self.storages):
            if index not in self.in_flight and compat.storage_use_count(storage) == 1:
                self.in_flight.add(index)
                return index
        return None

    def write(self, index: int, data: Any) -> Any:
        """In a worker: ``data`` with its tensors copied into buffer ``index`` and replaced by
        ``InBuffer``; ``data`` unchanged if its tensors do not fit."""
        tensors: list[torch.Tensor] = []
        _leaves(data, tensors)
        end, places = 0, []
        for tensor in tensors:
            end = -(-end // ALIGN) * ALIGN
            places.append(end)
            end += tensor.numel() * tensor.element_size()
        if end > self.capacity or any(t.device.type != "cpu" for t in tensors):
            return data
        where = iter(places)

        def put(tensor: torch.Tensor) -> InBuffer:
            place = InBuffer(next(where), tensor.dtype, tuple(tensor.shape))
            self._view(index, place).copy_(tensor)
            return place

        return _replace(data, put)

    def read(self, index: int, data: Any) -> Any:
        """Here: the batch as tensors that are views of buffer ``index``; the buffer is reusable
        once they are all gone."""
        self.in_flight.discard(index)
        return _replace(data, lambda place: self._view(index, place), InBuffer)

    def release(self, index: int) -> None:
        """A task's buffer that came back unused (its batch failed or travelled the usual way)."""
        self.in_flight.discard(index)

    def _view(self, index: int, place: InBuffer) -> torch.Tensor:
        size = place.dtype.itemsize
        return torch.empty(0, dtype=place.dtype).set_(self.storages[index], place.offset // size, place.shape)


def _leaves(data: Any, out: list[torch.Tensor]) -> None:
    if isinstance(data, torch.Tensor):
        out.append(data)
    elif isinstance(data, (list, tuple)):
        for item in data:
            _leaves(item, out)
    elif isinstance(data, dict):
        for item in data.values():
            _leaves(item, out)


def _replace(data: Any, fn: Any, kind: type = torch.Tensor) -> Any:
    """``data`` with each leaf of type ``kind`` replaced by ``fn(leaf)``, in the order ``_leaves`` visits."""
    if isinstance(data, kind):
        return fn(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a named tuple
        return type(data)(*(_replace(item, fn, kind) for item in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_replace(item, fn, kind) for item in data)
    if isinstance(data, dict):
        return type(data)((key, _replace(item, fn, kind)) for key, item in data.items())
    return data
