"""A chainable input pipeline in the manner of tf.data, run by ``torchdata.nodes``.

    pipeline = (loom.data.webdataset("shards/*.tar")
                .interleave(4)
                .shuffle(seed=0)
                .map(augment, num_parallel="auto")
                .batch(256)
                .prefetch("auto"))
    for images, labels in strategy.distribute(pipeline):   # the global batch: 256
        ...

A pipeline is a description; nothing is read until it is iterated. Operations on the order of
elements (interleave, shuffle, skip, take, repeat) act on addresses and run in a fixed order
(``loom.data.plan``); maps are one-to-one, so they commute with them and may come anywhere
before ``batch``. Each method returns a new pipeline.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import Dataset

from loom.data.plan import IndexOps
from loom.data.sources import DatasetSource, Source, TensorSource

if TYPE_CHECKING:
    from loom.data.runner import PipelineLoader

INDEX_ORDER = ("interleave", "shuffle", "skip", "take", "repeat")
METHODS = ("thread", "process")


@dataclass(frozen=True)
class MapStage:
    fn: Callable[[Any], Any]
    name: str


@dataclass(frozen=True)
class Pipeline:
    """Stages from a source to batches. Build one with ``loom.data``'s source functions."""

    source: Source
    ops: IndexOps = IndexOps()
    maps: tuple[MapStage, ...] = ()
    cache_after: int | None = None  # how many maps run before the cache
    num_parallel: int | str | None = None
    method: str = "thread"
    deterministic: bool = True
    batch_size: int | None = None
    drop_remainder: bool = False
    collate_fn: Callable[[list[Any]], Any] | None = None
    prefetch_depth: int | str | None = None
    index_ops_used: tuple[str, ...] = ()

    # ---- order of elements -----------------------------------------------------------------
    def interleave(self, cycle_length: int = 4, block_length: int = 1) -> Pipeline:
        """Read ``cycle_length`` files at once, ``block_length`` elements from each in turn."""
        _positive("cycle_length", cycle_length)
        _positive("block_length", block_length)
        return self._index_op("interleave", cycle_length=cycle_length, block_length=block_length)

    def shuffle(self, buffer: int | None = None, seed: int = 0) -> Pipeline:
        """Reshuffle every epoch, reproducibly from ``seed``.

        ``buffer=None`` draws a full permutation (cheap: only addresses are shuffled). A
        ``buffer`` of n keeps reads close to file order, as tf.data's shuffle does; use it for
        formats that decode in blocks (Parquet row groups).
        """
        if buffer is not None:
            _positive("buffer", buffer)
        return self._index_op("shuffle", shuffle=True, buffer=buffer, seed=seed)

    def skip(self, count: int) -> Pipeline:
        """Leave out the first ``count`` elements."""
        _positive("count", count, zero=True)
        return self._index_op("skip", skip=count)

    def take(self, count: int) -> Pipeline:
        """Keep only the first ``count`` elements."""
        _positive("count", count, zero=True)
        return self._index_op("take", take=count)

    def repeat(self, count: int | None = None) -> Pipeline:
        """``count`` epochs (None: forever) in one pass, each shuffled anew."""
        if count is not None:
            _positive("count", count)
        return self._index_op("repeat", repeat=count)

    # ---- elements --------------------------------------------------------------------------
    def map(
        self,
        fn: Callable[[Any], Any],
        num_parallel: int | str | None = None,
        method: str = "thread",
        deterministic: bool = True,
        name: str | None = None,
    ) -> Pipeline:
        """Apply ``fn`` to every element, in ``num_parallel`` workers (an int or ``"auto"``).

        ``method="thread"`` suits work that releases the GIL (decoding images, torch ops,
        reading files); ``"process"`` suits pure-Python work. With ``deterministic=False``
        elements may come out of order, as soon as they are ready. Consecutive maps run
        fused in the same worker; the pipeline uses the largest parallelism asked for.

        Random augmentation: with ``method="process"`` (or no workers) each batch's maps draw
        from torch, NumPy and ``random`` seeded by (shuffle seed, replica, epoch, batch), so
        replicas differ and a resumed run draws the same; thread workers share the process's
        generators, so their draws are neither per batch nor reproducible.
        """
        self._before_batch("map")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if num_parallel is not None and num_parallel != "auto":
            _positive("num_parallel", num_parallel)
        if self.maps and method != self.method:
            raise ValueError(f"all maps of a pipeline run in the same workers; got {self.method!r} and {method!r}")
        stage = MapStage(fn, name or getattr(fn, "__name__", f"map{len(self.maps) + 1}"))
        return dataclasses.replace(
            self,
            maps=self.maps + (stage,),
            num_parallel=_larger(self.num_parallel, num_parallel),
            method=method,
            deterministic=self.deterministic and deterministic,
        )

    def cache(self) -> Pipeline:
        """Keep elements in memory after the first epoch, as they are at this point of the chain.

        Maps before ``cache()`` run once per element; random augmentation belongs after it.
        """
        self._before_batch("cache")
        if self.cache_after is not None:
            raise ValueError("cache() is already in this pipeline; call it once")
        return dataclasses.replace(self, cache_after=len(self.maps))

    def batch(self, batch_size: int, drop_remainder: bool = False, collate_fn: Callable | None = None) -> Pipeline:
        """Group elements into batches (fused with the map: workers build whole batches).

        Under ``strategy.distribute`` this is the global batch, split over the replicas.
        """
        self._before_batch("batch")
        _positive("batch_size", batch_size)
        return dataclasses.replace(self, batch_size=batch_size, drop_remainder=drop_remainder, collate_fn=collate_fn)

    def prefetch(self, depth: int | str = "auto") -> Pipeline:
        """Prepare up to ``depth`` batches ahead (``"auto"``: two per thread worker, four per process
        worker) while one trains; in order, the workers run on into the next epoch."""
        if depth != "auto":
            _positive("depth", depth)
        return dataclasses.replace(self, prefetch_depth=depth)

    # ---- running ---------------------------------------------------------------------------
    def loader(
        self,
        num_replicas: int = 1,
        replica: int = 0,
        device: torch.device | str = "cpu",
        batch_size: int | None = None,
        shard_by: str = "auto",
    ) -> PipelineLoader:
        """The iterable one replica consumes; ``strategy.distribute`` calls this for you."""
        from loom.data.runner import PipelineLoader

        return PipelineLoader(self, num_replicas, replica, torch.device(device), batch_size, shard_by)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader())

    def __len__(self) -> int:
        return len(self.loader())

    # ---- checks ----------------------------------------------------------------------------
    def _index_op(self, op: str, **fields: Any) -> Pipeline:
        self._before_batch(op)
        if op in self.index_ops_used:
            raise ValueError(f"{op}() is already in this pipeline; call it once")
        later = [used for used in self.index_ops_used if INDEX_ORDER.index(used) > INDEX_ORDER.index(op)]
        if later:
            raise ValueError(
                f"{op}() after {later[0]}(): loom applies {', '.join(INDEX_ORDER)} in that order; "
                f"call {op}() before {later[0]}()"
            )
        return dataclasses.replace(
            self, ops=dataclasses.replace(self.ops, **fields), index_ops_used=self.index_ops_used + (op,)
        )

    def _before_batch(self, op: str) -> None:
        if self.batch_size is not None:
            raise ValueError(f"{op}() after batch(): call it before batch()")


# ---- sources ---------------------------------------------------------------------------------
def from_source(source: Source) -> Pipeline:
    """A pipeline over any ``loom.data.Source`` (write one for a format loom does not read)."""
    return Pipeline(source)


def from_tensors(*arrays: Any, **named: Any) -> Pipeline:
    """Rows of in-memory tensors or NumPy arrays: ``from_tensors(x, y)`` or ``from_tensors(image=x, label=y)``."""
    return Pipeline(TensorSource(*arrays, **named))


def from_dataset(dataset: Dataset) -> Pipeline:
    """The samples of a map-style torch ``Dataset``."""
    return Pipeline(DatasetSource(dataset))


def parquet(files: str | Iterable[str], columns: list[str] | None = None, errors: str = "raise") -> Pipeline:
    """Rows of Parquet files (a glob pattern or a list), as dicts of column values."""
    from loom.data.readers import ParquetSource

    return Pipeline(ParquetSource(files, columns=columns, errors=errors))


def webdataset(files: str | Iterable[str], decode: bool = True, errors: str = "raise") -> Pipeline:
    """Samples of tar shards in the WebDataset layout, as dicts keyed by file extension."""
    from loom.data.readers import WebDatasetSource

    return Pipeline(WebDatasetSource(files, errors=errors, decode=decode))


def image_folder(root: str | os.PathLike, decode: bool = True, errors: str = "raise") -> Pipeline:
    """``(image, label)`` from ``root/<class>/<image>``; ``decode=False`` yields the file's bytes."""
    from loom.data.readers import ImageFolderSource

    return Pipeline(ImageFolderSource(root, decode=decode, errors=errors))


def numpy_files(files: str | Iterable[str], key: str | None = None, errors: str = "raise") -> Pipeline:
    """Rows of ``.npy`` files (memory-mapped) or ``.npz`` archives."""
    from loom.data.readers import NumpySource

    return Pipeline(NumpySource(files, key=key, errors=errors))


def _positive(name: str, value: Any, zero: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if zero else 1):
        raise ValueError(f"{name} must be a {'non-negative' if zero else 'positive'} integer, got {value!r}")


def _larger(a: int | str | None, b: int | str | None) -> int | str | None:
    if a is None or b is None:
        return a if b is None else b
    if "auto" in (a, b):
        return "auto"
    return max(a, b)  # type: ignore[type-var]
