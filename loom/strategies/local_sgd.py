"""Local SGD and DiLoCo: replicas train alone for H steps, then meet. For machines joined by slow links.

Every replica runs its own optimizer (the *inner* one, the user's) on its share of each global
batch, with no communication in the backward pass. Every ``sync_every`` optimizer steps the
replicas meet once:

- ``LocalSGDStrategy`` averages their parameters (torch's model averager; Lin et al., 2018);
- ``DiLoCoStrategy`` (Douillard et al., 2023) treats ``anchor - local`` as a pseudo-gradient,
  averages it, and lets an *outer* optimizer (SGD with Nesterov momentum, lr 0.7, momentum 0.9)
  move the anchor, the model every replica agreed on last; each replica continues from it.

So a step sends nothing and a sync sends the model once: 1/H of synchronous data parallelism's
bytes. It is not the same training as synchronous data parallelism on the global batch (it
does not equal one device, except local SGD with ``sync_every=1`` and a linear optimizer such
as SGD with momentum); its quality has to be measured (``bench/slow_link.py``).

Buffers (BatchNorm's running statistics) are each replica's own between syncs, computed on
its own slice, and replaced by their mean over the replicas at every sync, together with the
parameters (DiLoCo averages them too: the outer step moves parameters only). Synchronised
BatchNorm is refused: it would all-reduce in every forward, which the local steps avoid.

``save`` first syncs replicas that have stepped since the last sync, so a checkpoint holds the
model every replica agrees on and restores under any strategy. The inner optimizers' state is
rank 0's (as for any replicated optimizer); DiLoCo's outer momentum starts afresh on restore.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from loom import comm
from loom.strategies.base import OptimizerFactory, unwrap
from loom.strategies.mirrored import MultiWorkerMirroredStrategy
from loom.strategies.optimizer import StrategyOptimizer


class Replicas:
    """One prepared model's parameters across replicas: counts inner steps, syncs every ``every``."""

    def __init__(self, module: nn.Module, every: int, outer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        self.every = every
        self.pending = 0  # inner steps since the replicas last met
        self.syncs = 0
        self._outer_factory = outer
        self.reset()

    def reset(self) -> None:
        """Start from the parameters as they are now (after broadcast or restore): they are the anchor."""
        self.pending = 0
        if self._outer_factory is None:
            self.anchor, self.outer = None, None
            return
        self.anchor = [p.detach().clone() for p in self.params]
        self.outer = self._outer_factory(self.anchor)

    def stepped(self) -> None:
        self.pending += 1
        if self.pending >= self.every:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Meet the other replicas: average (local SGD) or an outer step on the averaged pseudo-gradient (DiLoCo)."""
        if self.outer is None:
            average(self.params)
        else:
            for anchor, p in zip(self.anchor, self.params):
                anchor.grad = anchor - p  # the pseudo-gradient: how far this replica went, reversed
            average([a.grad for a in self.anchor])
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
            for anchor, p in zip(self.anchor, self.params):
                p.copy_(anchor)
        average(self.buffers)  # BatchNorm statistics: the replicas' mean
        self.pending = 0
        self.syncs += 1


def average(tensors: list[torch.Tensor]) -> None:
    """Replace each tensor with its mean over the replicas, in one flat all-reduce."""
    if not tensors:
        return
    from torch.distributed.algorithms.model_averaging.utils import average_parameters  # lazy: only when training

    average_parameters(iter(tensors), dist.group.WORLD)


class LocalStepOptimizer(StrategyOptimizer):
    """The user's optimizer; after each of its real steps the model's replicas may meet."""

    def __init__(self, wrapped: StrategyOptimizer, replicas: Replicas) -> None:
        super().__init__(wrapped.optimizer, wrapped.precision, wrapped._should_step)
        self.replicas = replicas

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if not self._should_step(self):
            return None
        result = self.precision.step(self.optimizer, closure)
        self.replicas.stepped()
        return result


class LocalSGDStrategy(MultiWorkerMirroredStrategy):
    """Every replica trains alone; parameters and buffers are averaged every ``sync_every`` optimizer steps.

    Args:
        sync_every: H, the optimizer steps between syncs.
        num_replicas, precision, timeout, backend: as for ``MirroredStrategy``.
        sync_batchnorm: refused (each replica keeps its own BatchNorm statistics between syncs).
    """

    def __init__(
        self,
        sync_every: int = 8,
        num_replicas: int | None = None,
        precision: str = "32",
        timeout: float | None = None,
        backend: str | None = None,
        sync_batchnorm: bool = False,
    ) -> None:
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"{type(self).__name__}(sync_every=...) must be a positive number of optimizer steps, got {sync_every!r}")
        if sync_batchnorm:
            raise ValueError(
                f"{type(self).__name__} cannot take sync_batchnorm=True: it would all-reduce BatchNorm statistics in every "
                "forward, which the local steps avoid; drop it (each replica keeps its own statistics, averaged at every sync)"
            )
        super().__init__(num_replicas=num_replicas, precision=precision, timeout=timeout, backend=backend)
        self.sync_every = sync_every
        self._replicas: weakref.WeakKeyDictionary[nn.Module, Replicas] = weakref.WeakKeyDictionary()  # by the user's module

    def _outer_optimizer(self) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None:
        return None

    def _wrap_model(self, module: nn.Module) -> nn.Module:
        with torch.no_grad():  # every replica starts from rank 0's model, as DDP's would
            for tensor in [*module.parameters(), *module.buffers()]:
                comm.broadcast(tensor.data, 0)
        self._replicas[module] = Replicas(module, self.sync_every, self._outer_optimizer())
        return module

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerFactory | None = None, **options: Any) -> Any:
        if optimizer is None:
            raise ValueError(
                f"{type(self).__name__} syncs the replicas after every {self.sync_every} optimizer steps, so it must "
                "step the optimizer: pass it to prepare(model, optimizer)"
            )
        wrapped, opt = super().prepare(model, optimizer, **options)
        return wrapped, LocalStepOptimizer(opt, self._replicas[model])

    def sync(self) -> None:
        """Meet now, for every prepared model whose replicas stepped since they last met."""
        with self._guard():
            for replicas in self._replicas.values():
                if replicas.pending:
                    replicas.sync()

    def save(self, directory: Any, **options: Any) -> Any:  # type: ignore[override]
        """Sync first: the checkpoint is the model every replica agrees on."""
        self.sync()
        return super().save(directory, **options)

    def restore(self, directory: Any, **options: Any) -> Any:  # type: ignore[override]
        restored = super().restore(directory, **options)
        for model in options.values():
            if isinstance(model, nn.Module) and unwrap(model) in self._replicas:
                self._replicas[unwrap(model)].reset()  # the restored parameters are the new anchor
        return restored

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", sync_every={self.sync_every})"


class DiLoCoStrategy(LocalSGDStrategy):
    """DiLoCo: every ``sync_every`` inner steps, an outer optimizer steps on the replicas' mean pseudo-gradient.

    Args:
        sync_every: H, the inner optimizer steps between syncs (the paper uses 500 on LLMs).
        outer_lr, outer_momentum: the outer SGD with Nesterov momentum (the paper's 0.7 and 0.9).
        num_replicas, precision, timeout, backend: as for ``MirroredStrategy``.
        sync_batchnorm: refused, as for ``LocalSGDStrategy``.
    """

    def __init__(
        self,
        sync_every: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        num_replicas: int | None = None,
        precision: str = "32",
        timeout: float | None = None,
        backend: str | None = None,
        sync_batchnorm: bool = False,
    ) -> None:
        if not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ValueError(
                f"DiLoCoStrategy needs outer_lr > 0 and 0 <= outer_momentum < 1, got outer_lr={outer_lr!r}, "
                f"outer_momentum={outer_momentum!r}"
            )
        super().__init__(sync_every, num_replicas=num_replicas, precision=precision, timeout=timeout, backend=backend, sync_batchnorm=sync_batchnorm)
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum

    def _outer_optimizer(self) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
        lr, momentum = self.outer_lr, self.outer_momentum
        return lambda anchor: torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)

