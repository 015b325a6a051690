"""DiLoCo across replica groups (FT-DiLoCo): each group trains alone for H steps, then the groups meet through torchft.

A *round* is up to ``sync_every`` global batches, never past an epoch's end (so every epoch ends
with the groups agreed):

1. quorum, once a round: the groups alive now. A group behind the others (restarted) heals in the
   quorum itself (torchft's synchronous heal), from a live group's state at the round's start
   (the anchor, buffers, inner optimizer, ``train_step``'s schedulers, the outer momentum and the
   data position), and then trains its share of the round like the others.
2. inner steps: each global batch of the round is split among the round's groups as under
   FT-DDP; within a group the N processes are DDP, and no step crosses the groups.
3. the meeting: each group's pseudo-gradient (anchor - its weights) and the change of its
   numeric buffers since the round's start, weighted by its share of the batches (integer ones:
   the groups' mean), are summed across the groups with the digests of the rounds each applied
   (``fault_tolerant_history``), and torchft votes. If every group's sum arrived, the outer
   optimizer (SGD with Nesterov momentum) steps the anchor on the summed pseudo-gradient and every
   group goes on from it. If a group died in the round, nobody applies it: every group goes back
   to the round's start (weights, buffers, inner optimizer and schedulers) and the groups alive
   then train its batches again. So every global batch is applied once, or not at all.

The round's start is kept until its meeting (the anchor, the buffers, and the inner optimizer's
state), both to go back to and to serve a heal with while the round's steps change the live
state; a checkpoint saved inside a round holds it too: it is what every group agrees on.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from loom.strategies.data_parallel.fault_tolerant import FaultTolerantMirroredStrategy, _flat_by_dtype, _unflat_by_dtype
from loom.strategies.data_parallel.local_sgd import check_outer_options, check_sync_every, nesterov_outer
from loom.strategies.optimizer import StrategyOptimizer


@dataclass
class _Round:
    first: int  # its first global batch
    length: int  # its global batches
    taken: int = 0  # its inner steps taken so far


@dataclass
class _Start:
    """A round's start, as the round's steps leave it: gone back to if the round is not applied, served to a heal, saved."""

    buffers: list[torch.Tensor]
    optimizer: dict[str, Any]
    schedulers: list[dict[str, Any]]


class FaultTolerantDiLoCoStrategy(FaultTolerantMirroredStrategy):
    """DiLoCo across replica groups: Mirrored (DDP) within a group, an outer step on the groups' pseudo-gradients every
    ``sync_every`` global batches, through torchft (see the module).

    ``committed`` is None during a round's inner steps (not known before its meeting), then says whether the round
    applied.

    Args:
        sync_every: H, the global batches of a round (fewer in an epoch's last round).
        outer_lr, outer_momentum: the outer SGD with Nesterov momentum (DiLoCo's 0.7 and 0.9).
        precision, timeout, **options: as for ``FaultTolerantMirroredStrategy``.
    """

    sums_every_step = False
    heals_in_its_step = False

    def __init__(self, sync_every: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9, precision: str = "32",
                 timeout: float | None = None, **options: Any) -> None:  # fmt: skip
        check_sync_every(type(self).__name__, sync_every)
        check_outer_options(type(self).__name__, outer_lr, outer_momentum)
        self.sync_every, self.outer_lr, self.outer_momentum = sync_every, outer_lr, outer_momentum
        super().__init__(precision=precision, timeout=timeout, **options)
        self._batches = 0  # global batches of the rounds the job applied (and of the checkpoint it resumed from)
        self._round: _Round | None = None
        self._start_state: _Start | None = None
        self._module: nn.Module | None = None

    # ---- the job's position -------------------------------------------------------------------
    def committed_batches(self) -> int:
        return self._batches

    def _resume_at(self, batches: int) -> None:
        self._batches = batches
        self._history.resume(batches)

    def _start_patience(self) -> float:
        """A restarted group waits for the live groups' next round, which starts only once their round has met, and
        a group at the meeting for the slowest group's round: one timeout for each of the round's steps."""
        return self.timeout * self.sync_every

    # ---- set-up and heals ---------------------------------------------------------------------
    def _before_start(self, module: nn.Module) -> None:
        self._module = module
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._trains = [p.requires_grad for p in module.parameters()]
        self._anchor = [p.detach().clone() for p in self._params]
        index = {id(p): i for i, p in enumerate(self._params)}
        self._anchor_of = {n: index[id(p)] for n, p in module.named_parameters(remove_duplicate=False) if id(p) in index}
        self._buffers = list(module.buffers())
        index = {id(b): i for i, b in enumerate(self._buffers)}
        self._buffer_of = {n: index[id(b)] for n, b in module.named_buffers(remove_duplicate=False)}
        self._outer = nesterov_outer(self.outer_lr, self.outer_momentum)(self._anchor)
        self._keep_start()

    def prepare(self, model: nn.Module, optimizer: Any = None, **options: Any) -> Any:  # type: ignore[override]
        wrapped, opt = super().prepare(model, optimizer, **options)
        self._anchor_here()  # the job's first weights (group 0's), or a live group's round start
        return wrapped, opt

    def train_step(self, model: nn.Module, loss_fn: Any, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                   max_grad_norm: float | None = None, accumulate: int = 1) -> Any:  # fmt: skip
        step = super().train_step(model, loss_fn, optimizer, scheduler, max_grad_norm, accumulate)
        if self._round is None or not self._round.taken:  # its scheduler is part of the round's start
            self._start_state.schedulers = [copy.deepcopy(s.state_dict()) for s in self._schedulers]
        return step

    @torch.no_grad()
    def _anchor_here(self) -> None:
        for anchor, p in zip(self._anchor, self._params):
            anchor.copy_(p)
        self._keep_start()

    def _keep_start(self) -> None:
        """Keep the round's start (before its quorum: a heal may be served from then on)."""
        self._start_state = _Start(
            buffers=[b.detach().clone() for b in self._buffers],
            optimizer=copy.deepcopy(self._local_optimizer_state(self._optimizer)),
            schedulers=[copy.deepcopy(s.state_dict()) for s in self._schedulers],
        )

    def _heal_state(self, module: nn.Module, inner: torch.optim.Optimizer) -> dict[str, Any]:
        """The round's start, not the live state: the round's steps change that while the heal is served. Served by
        reference: the anchor and the kept start change only after a meeting, which the healing group must join first."""
        start, live = self._start_state, module.state_dict()
        model = {k: self._anchor[self._anchor_of[k]] if k in self._anchor_of else start.buffers[self._buffer_of[k]] if k in self._buffer_of
                 else live[k] for k in live}  # fmt: skip
        return {"model": model, "optimizer": start.optimizer, "schedulers": start.schedulers, "history": self._history.state(),
                "clip": self._clip, "resumed": 0, "diloco": {"outer": _OuterState(self).state_dict(), "batches": self._batches}}  # fmt: skip

    def _load_heal(self, module: nn.Module, inner: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        """A live group's round start, in this group's quorum: it then trains the round as the others do."""
        super()._load_heal(module, inner, saved)
        _OuterState(self).load_state_dict(saved["diloco"]["outer"])
        self._batches = saved["diloco"]["batches"]
        self._heal_applied = False  # no step was taken in the heal: the schedulers are taken as they were
        self._take_schedulers()
        self._anchor_here()  # and keeps the round's start, schedulers included
        self._keeps_live_state = True
        self._events.write("healed", batch=self._batches, seconds=time.time() - self._asked, dropped=self._dropped)
        self._dropped = 0

    def _quorum(self, timeout: float | None = None) -> None:
        self._asked = time.time()
        super()._quorum(timeout)

    _asked = 0.0  # when the last quorum was asked for

    # ---- rounds -------------------------------------------------------------------------------
    def _next_batch(self, end: int) -> int | None:
        """The global batch this step trains: a round's next, or the first of a new round after its quorum."""
        if self._in_step:
            raise RuntimeError(
                "under --groups each batch that distribute() hands out is one optimizer step (its quorum decides its data): "
                "call optimizer.step() for every batch, and accumulate with train_step(accumulate=k), not strategy.accumulate()"
            )
        if self._round is None:
            batch = self.committed_batches()
            if batch >= end:
                return None
            if not self._quorum_ready:
                self._keep_start()
            self._take_quorum()
            if self.committed_batches() >= end:  # healed in it to a later epoch: its round is the next epoch's loop's
                self._quorum_ready = True
                return None
            self._round = _Round(self.committed_batches(), min(self.sync_every, end - self.committed_batches()))
        batch = self._round.first + self._round.taken
        self._take_part(batch, self._asked)
        return batch

    def _stepping_optimizer(self, inner: torch.optim.Optimizer) -> StrategyOptimizer:
        return _InnerOptimizer(inner, self.precision, self._may_step, self._inner_step)

    def _inner_step(self, update: Callable[[], Any]) -> Any:
        """An inner step on the batch that distribute() handed out; the round's last one meets the other groups."""
        if not self._in_step:
            raise RuntimeError(
                "under --groups each optimizer step trains the batch that strategy.distribute(...) hands out (its round's quorum "
                "decides its data): iterate that loader, one optimizer step per batch"
            )
        result = update()
        self._in_step = False
        self._round.taken += 1
        self.committed = None  # not known before the round's meeting
        if self._round.taken == self._round.length:
            self._meet()
        return result

    @torch.no_grad()
    def _meet(self) -> None:
        """Sum the groups' weighted pseudo-gradients and buffer changes, vote, and apply the outer step or go back to the round's start."""
        r, m = self._round, self.membership
        self._round = None
        if [p.requires_grad for p in self._module.parameters()] != self._trains:
            raise RuntimeError(
                "a parameter was frozen or unfrozen after prepare(): FaultTolerantDiLoCoStrategy meets the parameters that train at "
                "prepare(), so set requires_grad before it"
            )
        tensors = self._meeting_tensors(weight=m.samples / self._global_batch)
        history = self._history.slots(self.group, self.groups)
        self._sum_across_groups([*tensors, history])
        committed = self.committed = self._vote(history)
        if committed:
            self._history.advance(m.quorum_id)
            self._apply_meeting(tensors)
            self._batches += r.length
        else:
            self._go_back()
        self._events.write("commit" if committed else "refused", batch=r.first + r.length - 1 if committed else r.first,
                           first=r.first, last=r.first + r.length - 1, groups=list(m.groups))  # fmt: skip

    def _meeting_tensors(self, weight: float) -> list[torch.Tensor]:
        """What the groups sum at a meeting, flat by dtype: the weighted pseudo-gradients and changes of the floating
        buffers since the round's start, and the other numeric buffers' changes (boolean ones are left as they are)."""
        floating, counted = self._met_buffers()
        values = [(a - p.detach()) * weight for a, p in zip(self._anchor, self._params)]
        values += [(b - start) * weight for b, start in floating] + [b - start for b, start in counted]
        return list(_flat_by_dtype(values).values())

    def _met_buffers(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
        """(buffer, its value at the round's start) for the floating buffers, and for the integer ones."""
        pairs = list(zip(self._buffers, self._start_state.buffers))
        return [p for p in pairs if p[0].is_floating_point()], [p for p in pairs if not p[0].is_floating_point() and p[0].dtype != torch.bool]

    @torch.no_grad()
    def _apply_meeting(self, sums: list[torch.Tensor]) -> None:
        """The outer step on the summed pseudo-gradient; the buffers moved by the groups' weighted change (the integer
        ones by their mean change)."""
        floating, counted = self._met_buffers()
        pseudo = [torch.empty_like(a) for a in self._anchor]
        changes = [torch.empty_like(b) for b, _ in floating] + [torch.empty_like(b) for b, _ in counted]
        targets = [*pseudo, *changes]
        _unflat_by_dtype(dict(zip(_flat_by_dtype(targets), sums)), targets)
        participants = self._manager.num_participants()
        for (b, start), change in zip(floating, changes):
            b.copy_(start + change)
        for (b, start), change in zip(counted, changes[len(floating) :]):
            b.copy_(start + change // participants)
        for anchor, grad in zip(self._anchor, pseudo):
            anchor.grad = grad
        self._outer.step()
        self._outer.zero_grad(set_to_none=True)
        for anchor, p in zip(self._anchor, self._params):
            p.copy_(anchor)

    @torch.no_grad()
    def _go_back(self) -> None:
        """A round not applied: every group returns to its start, and its batches are trained again."""
        start = self._start_state
        for anchor, p in zip(self._anchor, self._params):
            p.copy_(anchor)
        for b, kept in zip(self._buffers, start.buffers):
            b.copy_(kept)
        self._optimizer.load_state_dict(self._whole_optimizer_state(self._optimizer, copy.deepcopy(start.optimizer)))
        for scheduler, saved in zip(self._schedulers, start.schedulers):
            scheduler.load_state_dict(saved)

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, directory: Any, *, step: int | None = None, **options: Any) -> Any:  # type: ignore[override]
        """As FT-DDP saves, with the outer momentum. Inside a round, what every group agrees on: the round's start (the
        anchor, its buffers, the inner optimizer's state and ``train_step``'s schedulers then, the data position at its
        first batch); the round's steps are trained again after a restore."""
        with self._at_round_start():
            return super().save(directory, step=step, **options, **{OUTER: _OuterState(self)})

    @contextmanager
    @torch.no_grad()
    def _at_round_start(self) -> Iterator[None]:
        """The model, optimizer and schedulers at the round's start for the while, where a round is under way."""
        if self._round is None or not self._round.taken:
            yield
            return
        live = ([p.detach().clone() for p in self._params], [b.detach().clone() for b in self._buffers],
                copy.deepcopy(self._optimizer.state_dict()), [copy.deepcopy(s.state_dict()) for s in self._schedulers])  # fmt: skip
        self._go_back()
        try:
            yield
        finally:
            params, buffers, optimizer, schedulers = live
            for p, kept in zip([*self._params, *self._buffers], [*params, *buffers]):
                p.copy_(kept)
            self._optimizer.load_state_dict(optimizer)
            for scheduler, saved in zip(self._schedulers, schedulers):
                scheduler.load_state_dict(saved)

    def restore(self, directory: Any, **options: Any) -> Any:  # type: ignore[override]
        """As FT-DDP restores; the anchor is the restored model, and the outer momentum is the saved one where the
        checkpoint holds it (one of another strategy does not: the momentum starts at zero)."""
        restored = super().restore(directory, **options)
        if restored is not None:
            self._anchor_here()
            self._outer.state.clear()
            from loom.checkpoint import layout  # lazy: only on restore

            if OUTER in layout.read_json(Path(restored["path"]) / "loom.json")["kinds"]:
                super().restore(restored["path"], **{OUTER: _OuterState(self)})
        return restored

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", sync_every={self.sync_every}, outer_lr={self.outer_lr}, outer_momentum={self.outer_momentum})"


OUTER = "loom_diloco_outer"  # the checkpoint's entry of the outer optimizer's state


class _OuterState:
    """The outer optimizer's momentum, as a checkpoint entry (a zero buffer moves SGD as no buffer does)."""

    def __init__(self, strategy: FaultTolerantDiLoCoStrategy) -> None:
        self._outer, self._anchor = strategy._outer, strategy._anchor

    def state_dict(self) -> dict[str, Any]:
        state = self._outer.state
        return {"momentum": {str(i): state[a]["momentum_buffer"] if "momentum_buffer" in state[a] else torch.zeros_like(a)
                             for i, a in enumerate(self._anchor)}}  # fmt: skip

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        for i, a in enumerate(self._anchor):
            self._outer.state[a]["momentum_buffer"] = saved["momentum"][str(i)].clone()


class _InnerOptimizer(StrategyOptimizer):
    """The user's optimizer, stepping within the group, each step through the strategy's round."""

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Any, should_step: Callable[[Any], bool],
                 inner_step: Callable[[Callable[[], Any]], Any]) -> None:  # fmt: skip
        super().__init__(optimizer, precision, should_step)
        self._inner_step = inner_step

    @torch.optim.Optimizer.profile_hook_step
    def _update(self, closure: Callable[[], Any] | None) -> Any:
        return self._inner_step(lambda: self.precision.step(self.optimizer, closure))
