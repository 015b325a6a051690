"""Where a pipeline's elements come from, each addressed as (shard, index).

A source says how many elements each shard (usually a file) holds and reads one element by
its address. Everything before the map (file order, sharding over replicas, interleave,
shuffle, take/skip/repeat) is decided on these addresses alone, so an epoch's order costs no
I/O to compute, a resumed pipeline skips ahead without reading what it skips, and the workers
of the parallel map do all the reading.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from loom.errors import DataFileError

ERROR_MODES = ("raise", "skip")


class Source:
    """Base class: subclasses set ``shards`` and implement ``shard_length`` and ``read``.

    ``auto_shard`` says how the AUTO policy splits it over replicas when there are enough
    shards: ``"file"`` (a replica reads whole shards) or ``"sample"`` (every replica takes its
    slice of each global batch; right when each shard holds one sample or there is one shard).
    Sources are pickled into process workers: keep open handles out of ``__getstate__``.
    """

    auto_shard = "file"

    def __init__(self, shards: Sequence[str], errors: str = "raise") -> None:
        if errors not in ERROR_MODES:
            raise ValueError(f"errors must be one of {ERROR_MODES}, got {errors!r}")
        self.shards = list(shards)
        self.errors = errors
        self.skipped: list[DataFileError] = []  # shards found unreadable while counting
        self._lengths: list[int] | None = None

    def shard_length(self, shard: int) -> int:
        raise NotImplementedError

    def read(self, shard: int, index: int) -> Any:
        raise NotImplementedError

    def lengths(self) -> list[int]:
        """Elements per shard, counted once; with ``errors='skip'`` an unreadable shard counts 0."""
        if self._lengths is None:
            lengths = []
            for shard in range(len(self.shards)):
                try:
                    lengths.append(self.shard_length(shard))
                except DataFileError as error:
                    if self.errors == "raise":
                        raise
                    self.skipped.append(error)
                    lengths.append(0)
            self._lengths = lengths
        return self._lengths

    def __len__(self) -> int:
        return sum(self.lengths())

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_open")}


class TensorSource(Source):
    """Rows of in-memory tensors or arrays with a common first dimension (one shard)."""

    auto_shard = "sample"

    def __init__(self, *arrays: Any, **named: Any) -> None:
        if bool(arrays) == bool(named):
            raise ValueError("from_tensors takes arrays as positional arguments or as keywords, not both or none")
        columns = [_as_tensor(a) for a in (arrays or named.values())]
        sizes = {len(c) for c in columns}
        if len(sizes) != 1:
            raise ValueError(f"from_tensors needs arrays of equal length, got lengths {sorted(sizes)}")
        super().__init__(["<tensors>"])
        self.columns = columns
        self.names = list(named) if named else None

    def shard_length(self, shard: int) -> int:
        return len(self.columns[0])

    def read(self, shard: int, index: int) -> Any:
        row = [c[index] for c in self.columns]
        if self.names:
            return dict(zip(self.names, row))
        return row[0] if len(row) == 1 else tuple(row)


class DatasetSource(Source):
    """A map-style torch ``Dataset`` (one shard, read by index)."""

    auto_shard = "sample"

    def __init__(self, dataset: Dataset) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(
                "from_dataset needs a map-style Dataset (with __len__ and __getitem__); "
                "pass an iterable dataset to strategy.distribute directly"
            )
        super().__init__([type(dataset).__name__])
        self.dataset = dataset

    def shard_length(self, shard: int) -> int:
        return len(self.dataset)

    def read(self, shard: int, index: int) -> Any:
        return self.dataset[index]


def expand_files(
    files: str | os.PathLike | Iterable[str | os.PathLike], what: str = "files", errors: str = "raise"
) -> list[str]:
    """A sorted list of files from a glob pattern, or a list of paths as given.

    A pattern that matches nothing is an error naming it; so is a listed file that does not
    exist, unless ``errors='skip'``, when the reader's count skips it like any unreadable file.
    """
    if isinstance(files, (str, os.PathLike)):
        pattern = os.fspath(files)
        found = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not found:
            raise FileNotFoundError(f"no {what} match {pattern!r}; check the path or the glob pattern")
        return found
    paths = [os.fspath(p) for p in files]
    if not paths:
        raise ValueError(f"the list of {what} is empty")
    for path in paths:
        if errors != "skip" and not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such file (listed in the {what})")
    return paths


def _as_tensor(array: Any) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    return torch.as_tensor(array)
