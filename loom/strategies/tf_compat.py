"""tf.distribute's names on every strategy, with TF's meaning, or one line naming loom's equivalent.

loom is SPMD: every process runs the whole script and is one replica (a TPU host drives all of
its devices, see TPUStrategy). So ``strategy.run(fn)`` calls ``fn`` once on this replica's
values, and every process calls it; a "per-replica value" is this process's plain value.

The loss convention differs from TF's, and silently: TF *sums* the replicas' gradients, so a
TF loop divides the loss by the global batch (``tf.nn.compute_average_loss``). loom *averages*
them (DDP), so the loss is the mean over this replica's samples, as on one device. Dividing by
the global batch under loom makes the gradients N times too small; ``compute_average_loss``
below takes TF's arguments and returns loom's loss.
"""

from __future__ import annotations

import enum
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from loom.data import Pipeline
from loom.data.loader import to_device

if TYPE_CHECKING:
    from loom.strategies.base import Strategy


class ReduceOp(str, enum.Enum):
    """``tf.distribute.ReduceOp``: ``strategy.reduce(ReduceOp.SUM, value, axis=None)``."""

    SUM = "sum"
    MEAN = "mean"


# TF's names that loom spells differently: each raises one line that names loom's way.
EQUIVALENTS = {
    "experimental_run_v2": "strategy.run(fn, args=...)",
    "experimental_distribute_datasets_from_function": "strategy.distribute_datasets_from_function(fn)",
    "experimental_distribute_values_from_function": "a plain value: each process is one replica (see strategy.replica_id)",
    "experimental_make_numpy_dataset": "strategy.distribute(torch.utils.data.TensorDataset(...), batch_size=GLOBAL_BATCH)",
    "make_dataset_iterator": "iter(strategy.distribute(dataset, batch_size=GLOBAL_BATCH))",
    "make_input_fn_iterator": "strategy.distribute_datasets_from_function(fn)",
    "extended": "the strategy's own options (docs/strategies/) and strategy.device",
    "cluster_resolver": "loom.cluster (TF_CONFIG is read by `loom run`)",
    "update_config_proto": "`loom run --threads N` (the CPU thread budget)",
    "colocate_vars_with": "strategy.prepare(model, ...), which places every parameter",
    "experimental_assign_to_logical_device": "TPUStrategy(mesh={'data': D, 'model': M})",
    "experimental_split_to_logical_devices": "TPUStrategy(mesh={'data': D, 'model': M})",
    "experimental_replicate_to_logical_devices": "TPUStrategy(mesh={'data': D, 'model': M})",
}


def reduce_arguments(value: Any, op: Any, axis: int | None = None) -> tuple[Any, str]:
    """loom's ``(value, op)`` from either order: ``reduce(value, "mean")`` or TF's ``reduce("SUM", value, axis)``.

    ``axis`` first reduces each replica's value along that axis, as TF does. For MEAN that is
    the mean over every replica's elements when the replicas' values are equally long there,
    which loom's equal per-replica slices make them.
    """
    if isinstance(value, (str, ReduceOp)) and not isinstance(op, (str, ReduceOp)):
        value, op = op, value
    op = op.value if isinstance(op, ReduceOp) else str(op).lower()
    if axis is not None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"reduce(axis={axis}) needs a tensor, not {type(value).__name__}; leave axis=None for a number")
        if op not in ("sum", "mean"):
            raise ValueError(f"reduce(axis=...) takes 'sum' or 'mean' (TF's ReduceOp), not {op!r}")
        value = value.sum(axis) if op == "sum" else value.double().mean(axis) if not value.is_floating_point() else value.mean(axis)
    return value, op


@dataclass(frozen=True)
class InputContext:
    """``tf.distribute.InputContext``: which of the job's input pipelines this process builds."""

    num_input_pipelines: int
    input_pipeline_id: int
    num_replicas_in_sync: int

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The global batch split evenly over the replicas; an uneven split is refused, as in TF."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global batch {global_batch_size} does not split over {self.num_replicas_in_sync} replicas; "
                f"use a multiple of {self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync


def compute_average_loss(
    per_example_loss: torch.Tensor, global_batch_size: int | None = None, strategy: Strategy | None = None
) -> torch.Tensor:
    """TF's ``tf.nn.compute_average_loss`` arguments, loom's loss: the gradient of the global mean.

    Without ``global_batch_size`` it is the mean over this replica's samples (what loom's loops
    use). With it, the sum over this replica's samples times ``num_replicas_in_sync / global_batch_size``:
    loom averages the replicas' gradients where TF sums them, so TF's plain ``sum / global_batch_size``
    would make them ``num_replicas_in_sync`` times too small.
    """
    if global_batch_size is None:
        return per_example_loss.mean()
    if strategy is None:
        raise ValueError(
            "compute_average_loss(global_batch_size=...) needs strategy=: loom averages gradients over "
            "its replicas, so the loss is scaled by strategy.num_replicas_in_sync"
        )
    return per_example_loss.sum() * (strategy.num_replicas_in_sync / global_batch_size)


class TFNames:
    """The tf.distribute methods every ``Strategy`` answers to (see the module's docstring)."""

    @contextmanager
    def scope(self: Strategy) -> Iterator[Strategy]:  # type: ignore[misc]
        """TF's ``with strategy.scope():``. Build the model anywhere: ``prepare`` (or ``fit``) places it.

        Nothing is created differently inside, so results do not depend on it.
        """
        yield self

    def run(self, fn: Callable[..., Any], args: Iterable[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """``fn(*args, **kwargs)`` on this replica's values. Every process runs it (SPMD)."""
        return fn(*args, **(kwargs or {}))

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This process's values as a tuple: one replica per process, so ``(value,)``."""
        return (value,)

    def experimental_distribute_dataset(self: Strategy, dataset: Any, options: Any = None) -> Any:  # type: ignore[misc]
        """``distribute`` with the dataset's own batch (a DataLoader's or a Pipeline's) as the global batch."""
        _no_options("experimental_distribute_dataset", options)
        batched = isinstance(dataset, DataLoader) or (isinstance(dataset, Pipeline) and dataset.batch_size is not None)
        if not batched and isinstance(dataset, Dataset) and not isinstance(dataset, IterableDataset):
            raise TypeError(
                "experimental_distribute_dataset takes a batched dataset (a DataLoader, whose batch_size is the "
                "global batch); for a Dataset use strategy.distribute(dataset, batch_size=GLOBAL_BATCH)"
            )
        return self.distribute(dataset)

    def distribute_datasets_from_function(self: Strategy, dataset_fn: Callable[[InputContext], Iterable[Any]], options: Any = None) -> OnDevice:  # type: ignore[misc]
        """``dataset_fn(ctx)`` builds this process's pipeline, already sharded and per-replica batched (as in TF).

        ``ctx`` is an ``InputContext``: ``input_pipeline_id`` of ``num_input_pipelines`` (one per
        process) and ``get_per_replica_batch_size(global_batch)``. Batches arrive on ``strategy.device``.
        """
        _no_options("distribute_datasets_from_function", options)
        return OnDevice(dataset_fn(self._input_context()), self.device)

    def _input_context(self) -> InputContext:
        """Which input pipeline this process builds: one per process, each feeding one replica."""
        return InputContext(self.num_replicas_in_sync, self.replica_id, self.num_replicas_in_sync)

    def __getattr__(self, name: str) -> Any:
        if name in EQUIVALENTS:
            raise AttributeError(f"{type(self).__name__} has no tf.distribute {name!r}: in loom use {EQUIVALENTS[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class OnDevice:
    """A user's per-replica batches, moved to the replica's device; iterable once per epoch."""

    def __init__(self, batches: Iterable[Any], device: torch.device) -> None:
        self.batches, self.device = batches, device

    def __iter__(self) -> Iterator[Any]:
        return (to_device(batch, self.device) for batch in self.batches)

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]


def _no_options(method: str, options: Any) -> None:
    if options is not None:
        raise ValueError(
            f"{method}(options=...) is TF's tf.distribute.InputOptions; loom's loader takes num_workers= and "
            "prefetches to the device already: drop options"
        )
