"""The work of one batch, in a worker thread or process: read each element, apply the maps, collate.

One task per batch (tf.data's fused map-and-batch): one queue hop per batch, not per element,
and collation runs in parallel too. ``BatchResult`` is what comes back, with the time each
stage took and the files skipped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from loom import compat
from loom.data.plan import Chunk
from loom.data.seeding import seeded
from loom.data.sources import Source
from loom.errors import DataFileError

if TYPE_CHECKING:
    from loom.data.pipeline import MapStage


@dataclass
class BatchResult:
    """What a worker sends back for one batch."""

    data: Any = None
    valid: int = 0
    seconds: list[float] = field(default_factory=list)  # read, each map, collate
    skipped: list[DataFileError] = field(default_factory=list)
    error: DataFileError | None = None
    buffer: int | None = None  # the shared buffer the task was given (``data``'s tensors lie in it)
    sequence: int = -1  # process workers: the task's place in the iteration (-1: an idle task)
    failure: Any = None  # process workers: what a map or collate_fn raised, to raise in its turn

    def pin_memory(self) -> BatchResult:
        """What the DataLoader's and torchdata's pinning threads call (CUDA): without it they
        would pass the result on as it is, and the copy to the device would not overlap."""
        self.data = compat.pinned(self.data)
        return self


class BatchWorker:
    """Reads, maps and collates one batch of addresses; runs in a worker thread or process."""

    def __init__(
        self,
        source: Source,
        maps: tuple[MapStage, ...],
        cache_after: int | None,
        collate: Callable[[list[Any]], Any],
        seeded: bool,
    ) -> None:
        self.source = source
        self.maps = maps
        self.cache_after = cache_after
        self.collate = collate
        self.seeded = seeded
        self.cache: dict[tuple[int, int], Any] = {}  # shared by threads; process workers refuse cache()

    def __call__(self, chunk: Chunk, collate: Callable[[list[Any]], Any] | None = None) -> BatchResult:
        """The batch's work under its own seed where the global generators are this worker's alone;
        ``collate`` in place of the pipeline's (one that builds the batch in a shared buffer)."""
        if not self.seeded:
            return self._run(chunk, collate or self.collate)
        with seeded(chunk.seed):
            return self._run(chunk, collate or self.collate)

    def _run(self, chunk: Chunk, collate: Callable[[list[Any]], Any]) -> BatchResult:
        """Stage by stage over the whole batch: two clock readings per stage, not per element."""
        seconds = [0.0] * (len(self.maps) + 2)
        elements: list[list[Any]] = []  # [address, value, index of the first map still to apply]
        skipped: list[DataFileError] = []
        valid = chunk.valid
        start = time.perf_counter()
        for position, key in enumerate(chunk.keys):
            if self.cache_after is not None and key in self.cache:
                elements.append([key, self.cache[key], self.cache_after])
                continue
            try:
                elements.append([key, self.source.read(*key), 0])
            except DataFileError as error:
                if self.source.errors == "raise":
                    return BatchResult(error=error)
                skipped.append(error)
                valid -= position < chunk.valid
        if not elements:
            return BatchResult(error=skipped[-1])
        seconds[0] = time.perf_counter() - start
        for i, stage in enumerate(self.maps):
            self._fill_cache(elements, i)
            start = time.perf_counter()
            for element in elements:
                if element[2] <= i:
                    element[1] = stage.fn(element[1])
            seconds[i + 1] = time.perf_counter() - start
        self._fill_cache(elements, len(self.maps))
        start = time.perf_counter()
        data = collate([element[1] for element in elements])
        seconds[-1] = time.perf_counter() - start
        return BatchResult(data, valid, seconds, skipped)

    def _fill_cache(self, elements: list[list[Any]], maps_done: int) -> None:
        if maps_done == self.cache_after:
            for key, value, first in elements:
                if first < maps_done:
                    self.cache[key] = value


def first(values: list[Any]) -> Any:
    """An unbatched pipeline's "collation": its one element."""
    return values[0]
