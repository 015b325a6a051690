"""The Strategy contract: the one object that changes between set-ups.

A training loop written against these methods runs unchanged under every strategy::

    model, opt = strategy.prepare(Net(), lambda params: torch.optim.SGD(params, lr=0.1))
    for x, y in strategy.distribute(dataset, batch_size=256):   # the global batch
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Iterator, TypeVar, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from loom import comm
from loom.checkpoint import Checkpointer
from loom.comm import Connection, preemption, resolve_timeout
from loom.data import DistributedLoader, Pipeline, PipelineLoader
from loom.strategies.optimizer import StrategyOptimizer
from loom.strategies.precision import AutocastModule, Precision

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
Number = TypeVar("Number", int, float)


class Strategy(ABC):
    """Where replicas run, how gradients are combined, how data is split between them."""

    def __init__(self, precision: str = "32", timeout: float | None = None) -> None:
        self.timeout = resolve_timeout(timeout)
        self._precision_name = precision
        self._connection: Connection | None = None
        self._accumulation_steps = 1
        self._micro_steps = 0

    # ---- topology ---------------------------------------------------------------------------
    @property
    @abstractmethod
    def num_replicas_in_sync(self) -> int:
        """Replicas whose gradients are combined in every step."""

    @property
    @abstractmethod
    def replica_id(self) -> int:
        """This process's replica, 0 .. num_replicas_in_sync - 1."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device this replica computes on; batches from ``distribute`` arrive there."""

    @property
    def is_chief(self) -> bool:
        """The replica that logs, prints and writes files that exist once per job."""
        return self.replica_id == 0

    @cached_property
    def precision(self) -> Precision:
        """Built on first use: subclasses know their device only after this class's __init__."""
        return Precision(self._precision_name, self.device)

    # ---- model and optimizer ----------------------------------------------------------------
    def _wrap_model(self, module: nn.Module) -> nn.Module:
        """Strategy-specific wrapping (DDP, FSDP, ...); the identity for one device."""
        return module

    def _skip_gradient_sync(self) -> ContextManager[Any]:
        """Context in which backward accumulates locally without communicating."""
        return nullcontext()

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerFactory | None = None
    ) -> Union[nn.Module, tuple[nn.Module, StrategyOptimizer]]:
        """Place and wrap ``model``; wrap ``optimizer`` (or build it from a factory on the placed params).

        The module passed in stays usable and holds the trained parameters (``loom.unwrap``
        returns it from the wrapped one). Returns ``model`` alone when no optimizer is given.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"prepare() takes an nn.Module, not {type(model).__name__}")
        module = model.to(self.device)
        with self._guard():
            wrapped = self.precision.wrap(self._wrap_model(module))
        if optimizer is None:
            return wrapped
        if isinstance(optimizer, torch.optim.Optimizer):
            inner = optimizer
            owned = {id(p) for p in module.parameters()}
            if not all(id(p) in owned for g in inner.param_groups for p in g["params"]):
                raise ValueError(
                    "the optimizer holds parameters that are not the model's; build it on this model's "
                    "parameters, or pass a factory: prepare(model, lambda params: torch.optim.SGD(params, lr=0.1))"
                )
        elif callable(optimizer):
            inner = optimizer(module.parameters())
            if not isinstance(inner, torch.optim.Optimizer):
                raise TypeError(f"the optimizer factory returned {type(inner).__name__}, not a torch.optim.Optimizer")
        else:
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory, not {type(optimizer).__name__}")
        return wrapped, StrategyOptimizer(inner, self.precision.scaler, self._at_step_boundary)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` with the strategy's gradient sync, scaling and accumulation."""
        self._micro_steps += 1
        if self._accumulation_steps > 1:
            loss = loss / self._accumulation_steps
        sync = self._at_step_boundary()
        with self._guard(), (nullcontext() if sync else self._skip_gradient_sync()):
            self.precision.scale(loss).backward()

    def _at_step_boundary(self) -> bool:
        return self._micro_steps % self._accumulation_steps == 0

    @contextmanager
    def accumulate(self, steps: int) -> Iterator[None]:
        """Inside, gradients of ``steps`` consecutive micro-batches are summed before each update.

        ``backward`` skips the all-reduce on the first ``steps - 1`` micro-batches (DDP's
        ``no_sync``) and scales the loss by ``1/steps``; ``optimizer.step()`` and
        ``zero_grad()`` act only on the last, so the loop itself does not change. An update
        over k micro-batches of size b equals one over a batch of k*b.
        """
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"accumulate() takes a positive number of micro-steps, got {steps!r}")
        if self._accumulation_steps != 1:
            raise RuntimeError("accumulate() is already active; nest the loop in one accumulate() only")
        self._accumulation_steps, self._micro_steps = steps, 0
        try:
            yield
        finally:
            leftover = self._micro_steps % steps
            self._accumulation_steps, self._micro_steps = 1, 0
            if leftover:
                warnings.warn(
                    f"accumulate({steps}) ended {leftover} micro-step(s) into a cycle; their gradients are "
                    "still in .grad and join the next update (make the steps per epoch a multiple of it)",
                    stacklevel=3,
                )

    # ---- data -------------------------------------------------------------------------------
    def distribute(
        self,
        data: Dataset | DataLoader | Pipeline | Iterable[Any],
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shard_by: str = "auto",
    ) -> DistributedLoader | PipelineLoader:
        """This replica's share of ``data`` in global batches of ``batch_size``.

        A ``loom.data.Pipeline`` keeps its own order, workers and batching (``batch_size``
        defaults to its ``batch()``) and is split over replicas by file or by sample
        (``shard_by``, see ``loom.data.plan``); ``shuffle``, ``seed``, ``drop_last``,
        ``num_workers`` and ``collate_fn`` apply to the other kinds of data. See
        ``loom.data.sharding`` for the order guarantees and the uneven-last-batch policy.
        """
        if isinstance(data, Pipeline):
            return data.loader(self.num_replicas_in_sync, self.replica_id, self.device, batch_size, shard_by)
        return DistributedLoader(
            data,
            batch_size,
            self.num_replicas_in_sync,
            self.replica_id,
            self.device,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            num_workers=num_workers,
            collate_fn=collate_fn,
        )

    # ---- cross-replica values ---------------------------------------------------------------
    def reduce(self, value: torch.Tensor | Number, op: str = "mean") -> torch.Tensor | Number:
        """Combine a tensor or a Python number over all replicas; every replica gets the result.

        ``op`` is one of ``loom.comm``'s: sum, mean, max, min, product.
        """
        if isinstance(value, torch.Tensor):
            tensor = value.detach().clone()
            if op == "mean" and not tensor.is_floating_point():
                tensor = tensor.double()
        elif isinstance(value, (int, float)):
            tensor = torch.tensor(float(value), dtype=torch.float64, device=self.device)
        else:
            raise TypeError(f"reduce() takes a tensor or a number, not {type(value).__name__}")
        with self._guard():
            comm.all_reduce(tensor, op)
        if isinstance(value, torch.Tensor):
            return tensor
        result = tensor.item()
        return int(result) if isinstance(value, int) and op != "mean" else result

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every replica's ``tensor`` concatenated along dim 0 in replica order (sizes may differ)."""
        with self._guard():
            return comm.all_gather(tensor.reshape(1) if tensor.dim() == 0 else tensor)

    def barrier(self) -> None:
        """Wait until every replica gets here."""
        with self._guard():
            comm.barrier()

    def _guard(self) -> ContextManager[None]:
        return self._connection.guard() if self._connection is not None else nullcontext()

    # ---- checkpoints -------------------------------------------------------------------------
    def save(
        self,
        directory: str | Path,
        *,
        step: int | None = None,
        keep: int = 3,
        async_save: bool = False,
        durable: bool = True,
        **state: Any,
    ) -> Path:
        """Save ``state`` as ``directory/step-<step>``; every replica calls it at the same point.

        ``state`` names what to keep: models, optimizers, anything with ``state_dict`` (the
        loader from ``distribute``, LR schedulers), tensors and JSON values. Restorable under
        any strategy and number of replicas; see ``loom.checkpoint``. ``step`` defaults to the
        one after the newest checkpoint in ``directory``. The last ``keep`` checkpoints are
        kept. With ``async_save`` training goes on while it is written. ``durable`` fsyncs
        every file before the commit, so a machine that loses power keeps it too. A replica
        that does not call it is named within ``LOOM_SAVE_TIMEOUT`` seconds (10).
        """
        peers = self._connection.monitor if self._connection is not None else None
        with self._guard():
            return self._checkpointer.save(directory, step, _unwrapped(state), keep, async_save, durable, peers)

    def restore(
        self, directory: str | Path, *, fallback: bool = False, strict: bool = True, **state: Any
    ) -> dict[str, Any] | None:
        """Load the newest complete checkpoint under ``directory`` into ``state``'s objects, in place.

        Returns the saved plain values and ``step``, or None when there is no checkpoint yet.
        ``fallback=True`` passes over a damaged checkpoint to the one before it.
        ``strict=False`` loads the tensors that the checkpoint and ``state`` both have (a
        pretrained body into a model with a new head); the others are returned as
        ``missing_keys`` and ``unexpected_keys``, and warned about once.
        """
        peers = self._connection.monitor if self._connection is not None else None
        with self._guard():
            return self._checkpointer.restore(directory, _unwrapped(state), fallback, strict, peers)

    def job_report(self) -> dict[str, float] | None:
        """Figures about the whole job that only some strategies have (parameter servers); else None."""
        return None

    def preempted(self) -> bool:
        """Whether any replica got SIGTERM since ``loom.comm.preemption.arm()``; call it on every replica.

        True on all replicas at once, so they can save together after the same step.
        """
        return bool(self.reduce(float(preemption.requested()), "max"))

    @cached_property
    def _checkpointer(self) -> Checkpointer:
        return Checkpointer(type(self).__name__)

    def shutdown(self) -> None:
        """Leave the job's process group (also done at exit), once a pending checkpoint is written."""
        if "_checkpointer" in self.__dict__:
            self._checkpointer.wait()
        if self._connection is not None:
            self._connection.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(replicas={self.num_replicas_in_sync}, replica={self.replica_id}, "
            f"device={self.device}, precision={self._precision_name!r})"
        )


WRAPPERS: tuple[type[nn.Module], ...] = (DistributedDataParallel, AutocastModule)


def _unwrapped(state: dict[str, Any]) -> dict[str, Any]:
    """The user's own modules and optimizers, so a checkpoint does not depend on the strategy."""
    return {
        name: unwrap(v) if isinstance(v, nn.Module) else v.optimizer if isinstance(v, StrategyOptimizer) else v
        for name, v in state.items()
    }


def unwrap(model: nn.Module) -> nn.Module:
    """The module the user passed to ``prepare``, from whatever wrappers the strategy added.

    Only loom's wrappers are peeled: a user's model may well have a submodule named ``module``.
    """
    while isinstance(model, WRAPPERS):
        model = model.module
    return model
