"""What a user's ``DataLoader`` asks for (order, batch, workers), honoured over replicas or refused.

Its ``batch_size`` is the global batch. A ``SequentialSampler`` means no shuffle; a plain
``RandomSampler`` means loom's seeded shuffle; any other sampler (weighted, subset, custom)
is sharded as Accelerate does: every replica draws the sampler's order for the epoch with the
same seed and takes its slice of each global batch. A ``DistributedSampler`` (already split for
DDP) and a custom ``batch_sampler`` cannot be split again, and are refused in one line.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)
from torch.utils.data.distributed import DistributedSampler

from loom.data.seeding import mix, seeded
from loom.data.sharding import index_dtype


@dataclass
class LoaderRequest:
    """A DataLoader's settings, merged with what was passed to ``distribute``."""

    dataset: Dataset
    batch_size: int | None
    shuffle: bool
    drop_last: bool
    seed: int
    num_workers: int
    collate_fn: Callable[[list[Any]], Any] | None
    sampler: Sampler | None = None  # None: loom's own order
    loader_args: dict[str, Any] = field(default_factory=dict)


def read_dataloader(
    loader: DataLoader,
    batch_size: int | None,
    shuffle: bool | None,
    drop_last: bool | None,
    seed: int,
    num_workers: int | None,
    collate_fn: Callable[[list[Any]], Any] | None,
) -> LoaderRequest:
    """``loader``'s settings; ``distribute``'s arguments, where given, must agree with them."""
    sampler, own_batch, own_drop_last = _batching(loader)
    if isinstance(sampler, DistributedSampler):
        global_batch = (own_batch or 1) * sampler.num_replicas
        raise ValueError(
            f"this DataLoader shards with a DistributedSampler (DDP's: batch_size={own_batch} per replica); loom "
            f"shards for you and reads batch_size as the global batch: pass DataLoader(dataset, "
            f"batch_size={global_batch}, shuffle={sampler.shuffle}) or the dataset itself"
        )
    order: Sampler | None = sampler
    own_shuffle: bool | None = None  # None: the sampler decides
    if isinstance(loader.dataset, IterableDataset):  # a DataLoader cannot shuffle a stream; loom's buffer may
        order, own_shuffle = None, bool(shuffle)
    elif type(sampler) is SequentialSampler:
        order, own_shuffle = None, False
    elif type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(sampler.data_source):
        order, own_shuffle = None, True
        if sampler.generator is not None:  # the user seeded it: that seed, not loom's
            seed = sampler.generator.initial_seed()
    if shuffle is not None and shuffle != own_shuffle:
        what = "no shuffle" if own_shuffle is False else "shuffle" if own_shuffle else "the order it draws"
        raise ValueError(
            f"distribute(shuffle={shuffle}) conflicts with the DataLoader's {type(sampler).__name__} ({what}); "
            "leave shuffle out (None) to keep the DataLoader's order, or build the DataLoader as you want it"
        )
    if batch_size is not None and own_batch is not None and batch_size != own_batch:
        raise ValueError(
            f"distribute(batch_size={batch_size}) conflicts with the DataLoader's batch_size={own_batch} (the global "
            "batch): leave batch_size out to keep the DataLoader's, or build the DataLoader with the one you want"
        )
    if drop_last is not None and drop_last != own_drop_last:
        raise ValueError(
            f"distribute(drop_last={drop_last}) conflicts with the DataLoader's drop_last={own_drop_last}; "
            "leave drop_last out (None) or build the DataLoader with the one you want"
        )
    loader_args: dict[str, Any] = {
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "timeout": loader.timeout,
    }
    workers = loader.num_workers if num_workers is None else num_workers
    if workers and loader.num_workers:
        loader_args["prefetch_factor"] = loader.prefetch_factor
    return LoaderRequest(
        dataset=loader.dataset,
        batch_size=batch_size or own_batch,
        shuffle=bool(own_shuffle),
        drop_last=own_drop_last,
        seed=seed,
        num_workers=workers,
        collate_fn=collate_fn or loader.collate_fn,
        sampler=order,
        loader_args=loader_args,
    )


def _batching(loader: DataLoader) -> tuple[Sampler, int | None, bool]:
    """The sampler under the DataLoader's batches, their size and drop_last."""
    if loader.batch_size is not None:  # the DataLoader built BatchSampler(sampler, batch_size, drop_last)
        return loader.sampler, loader.batch_size, loader.drop_last
    batches = loader.batch_sampler
    if batches is None:
        raise ValueError(
            "this DataLoader has batch_size=None (it yields single samples); give it the global batch_size, "
            "or pass batch_size= to distribute()"
        )
    if type(batches) is BatchSampler:
        return batches.sampler, batches.batch_size, batches.drop_last
    raise ValueError(
        f"the DataLoader's batch_sampler ({type(batches).__name__}) makes batches loom cannot split over "
        "replicas; pass a sampler and batch_size (the global batch) instead, or split its batches yourself"
    )


def sampler_order(sampler: Sampler, seed: int, epoch: int) -> torch.Tensor:
    """The user sampler's order for ``epoch``, drawn identically on every replica.

    Its generator (or, if it has none, torch's, NumPy's and Python's global ones) is seeded
    from ``seed`` and the epoch for the draw: the same order on every replica, a new one each
    epoch, the same again after a resume. A sampler with ``set_epoch`` is told the epoch.
    """
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    try:
        count = len(sampler)  # type: ignore[arg-type]
    except TypeError:
        name = type(sampler).__name__
        raise TypeError(f"the DataLoader's sampler ({name}) has no len(); loom needs it to plan the epoch") from None
    own = getattr(sampler, "generator", None)
    base = own.initial_seed() if own is not None else seed
    draw_seed = mix(base, epoch)
    with seeded(draw_seed), _generator(sampler, torch.Generator().manual_seed(draw_seed)):
        try:
            order = np.fromiter(iter(sampler), dtype=np.int64, count=count)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"the DataLoader's sampler ({type(sampler).__name__}) must yield {count} integer indices per epoch "
                f"(its len()); it did not: {error}"
            ) from None
    return torch.from_numpy(order).to(index_dtype(int(order.max(initial=0)) + 1))


@contextmanager
def _generator(sampler: Sampler, generator: torch.Generator) -> Iterator[None]:
    """``sampler.generator`` swapped for ``generator`` while it draws, when it has that attribute."""
    if not hasattr(sampler, "generator"):
        yield
        return
    own = sampler.generator
    sampler.generator = generator
    try:
        yield
    finally:
        sampler.generator = own
