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

With ``overlap_sync=True`` DiLoCo does not wait for the replicas at a sync: it sends its
pseudo-gradient in the background and trains on; the outer step on the mean arrives one period
late, at the next sync, and replaces this replica's own progress of that period with it while
keeping the progress made since (the one-period delay of overlapped DiLoCo, Kale et al. 2025;
Streaming DiLoCo overlaps the same way, Douillard et al. 2025). On a slow link that hides the
sync's all-reduce behind H inner steps; the price is an outer step one period late, and momentum
on late steps overshoots more: in ``bench/slow_link.py`` (tiny GPT, H=16) the paper's outer
step (0.7, 0.9) ended 2.5% above synchronous training's validation loss, and ``outer_lr=0.5``
0.3% below, as plain DiLoCo's 0.7 did (0.7% below). (Going on from an eager guess, the outer
step on this replica's own pseudo-gradient, was no better there: 2.8% above.)

Buffers (BatchNorm's running statistics) are each replica's own between syncs, computed on
its own slice, and replaced by their mean over the replicas at every sync, together with the
parameters (DiLoCo averages them too: the outer step moves parameters only). Synchronised
BatchNorm is refused: it would all-reduce in every forward, which the local steps avoid.

``save`` changes nothing about the training that follows: it does not sync. Under the model's
name it writes the model the replicas agree on (their mean while they are apart, which is what
local SGD's next sync would make), so the checkpoint restores under any strategy; under the
optimizer's name replica 0's inner optimizer state. Beside them, ``<name>_replica<r>`` holds what
is replica r's own (its parameters and buffers while apart, where its overlapped period began,
its optimizer's tensors, its fp16 loss scale) and ``<name>_local_sgd`` what they hold alike (the
steps into the period, DiLoCo's anchor, outer momentum and the mean in flight). Restored on the
same number of replicas, every replica goes on from its own state, bit for bit as the run that
was saved (``tests/checkpoint/test_kill_matrix.py`` kills one mid-period). On another number, or
from another strategy's checkpoint, every replica starts from the saved model and replica 0's
optimizer state, as after a sync (DiLoCo keeps its saved outer momentum); another number of
replicas is warned about, since the run goes on differently from then.
"""

from __future__ import annotations

import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from loom import comm
from loom.strategies.base import OptimizerFactory, unwrap
from loom.strategies.data_parallel.local_sgd_comms import InFlight, average
from loom.strategies.data_parallel.local_sgd_state import REPLICA_SUFFIX, SHARED_SUFFIX, Absent, ReplicaState, SharedState, agreed
from loom.strategies.data_parallel.mirrored import MultiWorkerMirroredStrategy
from loom.strategies.optimizer import StrategyOptimizer, inner_optimizer


class Replicas:
    """One prepared model's parameters across replicas: counts inner steps, syncs every ``every``."""

    def __init__(
        self,
        module: nn.Module,
        every: int,
        outer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None,
        overlap: bool = False,
        apart: dict[int, Replicas] | None = None,
    ) -> None:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        floating = [(n, b) for n, b in module.named_buffers() if b.is_floating_point()]
        self.buffer_names = [n for n, _ in floating]
        self.buffers = [b for _, b in floating]
        self.every = every
        self.overlap = overlap
        self.pending = 0  # inner steps since the replicas last met
        self.syncs = 0
        self.outer_steps = 0
        self.in_flight: InFlight | None = None  # overlapped: the last period's pseudo-gradient, being averaged
        self._outer_factory = outer
        self.module = weakref.ref(module)  # the user's: a dropped one may still have to meet (``LocalSGDStrategy._apart``)
        self._apart = {} if apart is None else apart  # the strategy's: every Replicas apart, in the order they went apart
        self.reset()

    def reset(self) -> None:
        """Start from the parameters as they are now (after broadcast or restore): they are the anchor."""
        if self.in_flight is not None:  # a collective once started is finished on every replica
            self.in_flight.mean()
            self.in_flight = None
        self.pending = 0
        self.outer_steps = 0
        if self._outer_factory is None:
            self.anchor, self.outer, self.start = None, None, None
            return
        self.anchor = [p.detach().clone() for p in self.params]
        self.outer = self._outer_factory(self.anchor)
        self.start = [p.detach().clone() for p in self.params] if self.overlap else None  # where this period began

    def stepped(self) -> None:
        self.pending += 1
        if self.pending >= self.every:
            self.sync_overlapped() if self.overlap else self.sync()
        self.noted()

    def noted(self) -> None:
        """Tell the strategy whether these replicas are apart (they stepped, or restored a period, since they met)."""
        if self.apart:
            self._apart.setdefault(id(self), self)
        else:
            self._apart.pop(id(self), None)

    @property
    def apart(self) -> bool:
        """Whether the replicas hold models they have not yet agreed on."""
        return bool(self.pending) or self.in_flight is not None

    @torch.no_grad()
    def sync(self) -> None:
        """Meet the other replicas and agree: average (local SGD) or an outer step on the averaged pseudo-gradient (DiLoCo)."""
        if self.outer is None:
            average(self.params)
        else:
            self._apply_in_flight()
            if self.pending:
                for anchor, p in zip(self.anchor, self.params):
                    anchor.grad = anchor - p  # the pseudo-gradient: how far this replica went, reversed
                average([a.grad for a in self.anchor])
                self._outer_step()
            for anchor, p in zip(self.anchor, self.params):
                p.copy_(anchor)
            if self.start is not None:
                for start, p in zip(self.start, self.params):
                    start.copy_(p)
        average(self.buffers)  # BatchNorm statistics: the replicas' mean
        self.pending = 0
        self.syncs += 1

    @torch.no_grad()
    def sync_overlapped(self) -> None:
        """Apply the outer step on the last period's mean, then send this period's pseudo-gradient and go on."""
        self._apply_in_flight()
        self.in_flight = InFlight([a - p for a, p in zip(self.anchor, self.params)])  # this period's progress, reversed
        for start, p in zip(self.start, self.params):
            start.copy_(p)
        average(self.buffers)  # small: BatchNorm statistics are still averaged at the sync itself
        self.pending = 0
        self.syncs += 1

    def _apply_in_flight(self) -> None:
        """The outer step on the mean that was in flight; this replica's own progress of that period gives way to it."""
        if self.in_flight is None:
            return
        for anchor, mean in zip(self.anchor, self.in_flight.mean()):
            anchor.grad = mean
        self.in_flight = None
        self._outer_step()
        for anchor, start, p in zip(self.anchor, self.start, self.params):
            p.add_(anchor - start)  # the progress since the period ended, on the new anchor

    def _outer_step(self) -> None:
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self.outer_steps += 1



class LocalStepOptimizer(StrategyOptimizer):
    """The user's optimizer; after each of its real steps the model's replicas may meet."""

    def __init__(self, wrapped: StrategyOptimizer, replicas: Replicas) -> None:
        super().__init__(wrapped.optimizer, wrapped.precision, wrapped._should_step)
        self.replicas = replicas

    @torch.optim.Optimizer.profile_hook_step  # the step hooks around the update and the meeting after it
    def _update(self, closure: Callable[[], Any] | None) -> Any:
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
        check_sync_every(type(self).__name__, sync_every)
        if sync_batchnorm:
            raise ValueError(
                f"{type(self).__name__} cannot take sync_batchnorm=True: it would all-reduce BatchNorm statistics in every "
                "forward, which the local steps avoid; drop it (each replica keeps its own statistics, averaged at every sync)"
            )
        super().__init__(num_replicas=num_replicas, precision=precision, timeout=timeout, backend=backend)
        self.sync_every = sync_every
        self._replicas: weakref.WeakKeyDictionary[nn.Module, Replicas] = weakref.WeakKeyDictionary()  # by the user's module
        # Those whose replicas stepped since they last met, held until they meet: ``sync`` meets for these, the
        # same in every process. (Not every model that still lives: when a dropped one goes is each
        # process's garbage collector's doing.)
        self._apart: dict[int, Replicas] = {}

    _overlap_sync = False

    def _outer_optimizer(self) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None:
        return None

    def _forget_dropped(self) -> None:
        """Let go of the apart models that every process has dropped (collective): nobody trains them or
        meets for them again. One that some process still holds stays, so that every process meets for it."""
        entries = list(self._apart.items())
        if not entries:
            return  # in every process alike: they prepared and stepped the same models
        held = comm.all_reduce(torch.tensor([float(r.module() is not None) for _, r in entries]), "max")
        for (key, _), anywhere in zip(entries, held.tolist()):
            if not anywhere:
                del self._apart[key]

    def _wrap_model(self, module: nn.Module) -> nn.Module:
        self._forget_dropped()
        with torch.no_grad():  # every replica starts from rank 0's model, as DDP's would
            for tensor in [*module.parameters(), *module.buffers()]:
                comm.broadcast(tensor.data, 0)
        self._replicas[module] = Replicas(module, self.sync_every, self._outer_optimizer(), self._overlap_sync, self._apart)
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
        """Meet now and agree, for every prepared model whose replicas stepped (or have a sync in flight) since they last
        agreed, dropped ones that some process still holds included: every process meets for the same models, in the
        order they went apart."""
        with self._guard():
            self._forget_dropped()
            for key, replicas in list(self._apart.items()):
                if replicas.apart:
                    replicas.sync()
                del self._apart[key]

    def _prepared(self, state: dict[str, Any]) -> dict[str, Replicas]:
        return {name: self._replicas[unwrap(m)] for name, m in state.items() if isinstance(m, nn.Module) and unwrap(m) in self._replicas}

    def _optimizers_of(self, state: dict[str, Any], models: dict[str, Replicas]) -> dict[str, dict[str, torch.optim.Optimizer]]:
        """By model name: the optimizers in ``state`` that step its parameters, by their own names."""
        found: dict[str, dict[str, torch.optim.Optimizer]] = {name: {} for name in models}
        for key, value in state.items():
            if isinstance(value, torch.optim.Optimizer):
                first = next(p for group in value.param_groups for p in group["params"])
                for name, replicas in models.items():
                    if any(first is p for p in replicas.params):
                        found[name][key] = inner_optimizer(value)
        return found

    def save(self, directory: Any, **options: Any) -> Any:  # type: ignore[override]
        """The model the replicas agree on, and each replica's own state beside it; the training is left as it was.

        Under the model's name: the replicas' mean while they are apart (what local SGD's next sync
        would make), else the model they agreed on. Its optimizers' names hold replica 0's state;
        ``<name>_replica<r>`` replica r's own, ``<name>_local_sgd`` the period and DiLoCo's outer state.
        """
        models = self._prepared(options)
        optimizers = self._optimizers_of(options, models)
        rank, scaler = self.replica_id, self.precision.scaler
        state = dict(options)
        for name, replicas in models.items():
            state[f"{name}{SHARED_SUFFIX}"] = SharedState(replicas, scaled=scaler is not None and scaler.is_enabled())
            for r in range(self.num_replicas_in_sync):
                state[f"{name}{REPLICA_SUFFIX}{r}"] = ReplicaState(replicas, optimizers[name] if r else None, scaler, mine=r == rank)
            if rank:  # replica 0's optimizers are saved under their own names; this one's in its part
                state.update({key: Absent() for key in optimizers[name]})
        with self._guard(), agreed([r for r in models.values() if r.apart]):
            return super().save(directory, **state)

    def restore(self, directory: Any, **options: Any) -> Any:  # type: ignore[override]
        """Each replica goes on from its own state, as the saved run did (same number of replicas).

        On another number of replicas, or from another strategy's checkpoint, every replica starts
        from the saved model and replica 0's optimizer state, as after a sync (DiLoCo keeps the outer
        momentum it saved). With no checkpoint yet nothing changes.
        """
        models = self._prepared(options)
        restored = super().restore(directory, **options)  # the agreed model, replica 0's optimizers, the rest
        if restored is None:
            return None
        from loom.checkpoint import layout  # lazy: only on restore

        plain = layout.read_json(Path(restored["path"]) / "loom.json")["plain"]
        optimizers = self._optimizers_of(options, models)
        own: dict[str, Any] = {}
        for name, replicas in models.items():
            replicas.reset()  # the restored parameters are the anchor, unless the checkpoint says more
            saved = plain.get(f"{name}{SHARED_SUFFIX}")
            if saved is None:  # saved under another strategy
                continue
            same = saved["replicas"] == self.num_replicas_in_sync
            own[f"{name}{SHARED_SUFFIX}"] = SharedState(replicas, saved=saved, period=same)
            if same:
                own[f"{name}{REPLICA_SUFFIX}{self.replica_id}"] = ReplicaState(
                    replicas, optimizers[name] if self.replica_id else None, self.precision.scaler, True, saved
                )
            elif self.is_chief:
                warnings.warn(
                    f"loom: {restored['path']} holds {saved['replicas']} replicas of '{name}' and this job has "
                    f"{self.num_replicas_in_sync}: every replica starts from their mean with replica 0's optimizer state, as after a sync",
                    stacklevel=2,
                )
        if own:
            super().restore(restored["path"], **own)
        for replicas in models.values():
            replicas.noted()  # a restored period is apart
        return restored

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", sync_every={self.sync_every})"


class DiLoCoStrategy(LocalSGDStrategy):
    """DiLoCo: every ``sync_every`` inner steps, an outer optimizer steps on the replicas' mean pseudo-gradient.

    Args:
        sync_every: H, the inner optimizer steps between syncs (the paper uses 500 on LLMs).
        outer_lr, outer_momentum: the outer SGD with Nesterov momentum (the paper's 0.7 and 0.9).
        overlap_sync: send each sync's pseudo-gradient in the background and train on; its outer
            step is applied one period late, at the next sync (the module's docstring says how).
            For slow links, where the sync's all-reduce would otherwise stall every replica; take a
            smaller outer step with it (``outer_lr=0.5`` kept the benchmark's quality).
        num_replicas, precision, timeout, backend: as for ``MirroredStrategy``.
        sync_batchnorm: refused, as for ``LocalSGDStrategy``.
    """

    def __init__(
        self,
        sync_every: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        overlap_sync: bool = False,
        num_replicas: int | None = None,
        precision: str = "32",
        timeout: float | None = None,
        backend: str | None = None,
        sync_batchnorm: bool = False,
    ) -> None:
        check_outer_options("DiLoCoStrategy", outer_lr, outer_momentum)  # sync_every: LocalSGDStrategy's
        if not isinstance(overlap_sync, bool):
            raise ValueError(f"DiLoCoStrategy(overlap_sync=...) must be True or False, got {overlap_sync!r}")
        super().__init__(sync_every, num_replicas=num_replicas, precision=precision, timeout=timeout, backend=backend, sync_batchnorm=sync_batchnorm)
        self.outer_lr, self.outer_momentum, self._overlap_sync = outer_lr, outer_momentum, overlap_sync

    def _outer_optimizer(self) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
        return nesterov_outer(self.outer_lr, self.outer_momentum)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + (", overlap_sync=True)" if self._overlap_sync else ")")


def check_sync_every(strategy: str, sync_every: Any) -> None:
    if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
        raise ValueError(f"{strategy}(sync_every=...) must be a positive number of optimizer steps, got {sync_every!r}")


def check_outer_options(strategy: str, outer_lr: float, outer_momentum: float) -> None:
    if not outer_lr > 0 or not 0 <= outer_momentum < 1:
        raise ValueError(f"{strategy} needs outer_lr > 0 and 0 <= outer_momentum < 1, got outer_lr={outer_lr!r}, outer_momentum={outer_momentum!r}")


def nesterov_outer(lr: float, momentum: float) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """DiLoCo's outer optimizer on the anchor: SGD with Nesterov momentum."""
    return lambda anchor: torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=momentum > 0)
