"""DiLoCo across replica groups (FT-DiLoCo): each group trains alone for H steps, then the groups meet through torchft.

A *round* is up to ``sync_every`` global batches, never past an epoch's end (so every epoch ends
with the groups agreed, and ``fit``'s checkpoints fall between rounds):

1. quorum, once a round: the groups alive now. A group behind the others (restarted) heals in it
   from a live group's state at the start of the round (the anchor, buffers, inner optimizer,
   ``train_step``'s schedulers, the outer momentum and the data position), and takes part in the
   round without data.
2. inner steps: each global batch of the round is split among the round's groups as under
   FT-DDP; within a group the N processes are DDP, and no step crosses the groups.
3. the meeting: each group's pseudo-gradient (anchor - its weights) and floating buffers, weighted
   by its share of the batches, are summed across the groups (integer buffers are the groups'
   mean), with the digests of the rounds each applied (``fault_tolerant_history``), and torchft
   votes. If every group's sum arrived, the outer optimizer (SGD with Nesterov momentum) steps the
   anchor on the summed pseudo-gradient and every group goes on from it. If a group died in the
   round, nobody applies it: every group goes back to the round's start (weights, buffers, inner
   optimizer and schedulers) and the groups alive then train its batches again. So every global
   batch is applied once, or not at all.

With one group and ``sync_every=1`` and ``outer_lr=1, outer_momentum=0`` it is FT-DDP's training;
in general it is DiLoCo's (``DiLoCoStrategy``), on the groups' shares of each batch. A round's
start is kept until its meeting (weights, buffers and the inner optimizer's state: about one more
copy of the model and of the optimizer's state), both to go back to and to serve a heal with
while the round's steps change the live state.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from loom.compat import ft_healing, ft_quorum_id
from loom.strategies.data_parallel.fault_tolerant import FaultTolerantMirroredStrategy, _flat_by_dtype, _unflat_by_dtype
from loom.strategies.data_parallel.local_sgd import check_diloco_options, nesterov_outer
from loom.strategies.optimizer import StrategyOptimizer


@dataclass
class _Round:
    first: int  # its first global batch
    length: int  # its global batches
    taken: int = 0  # its inner steps taken so far


@dataclass
class _Start:
    """A round's start, as the round's steps leave it: gone back to if the round is not applied, and served to a heal."""

    buffers: dict[str, torch.Tensor]  # the state dict's entries that are not trained parameters
    optimizer: dict[str, Any]
    schedulers: list[dict[str, Any]]


class FaultTolerantDiLoCoStrategy(FaultTolerantMirroredStrategy):
    """DiLoCo across replica groups: Mirrored (DDP) within a group, an outer step on the groups' pseudo-gradients every
    ``sync_every`` global batches, through torchft (see the module).

    Args:
        sync_every: H, the global batches of a round (fewer in an epoch's last round).
        outer_lr, outer_momentum: the outer SGD with Nesterov momentum (DiLoCo's 0.7 and 0.9).
        precision, timeout, **options: as for ``FaultTolerantMirroredStrategy``.
    """

    sums_every_step = False

    def __init__(self, sync_every: int = 50, outer_lr: float = 0.7, outer_momentum: float = 0.9, precision: str = "32",
                 timeout: float | None = None, **options: Any) -> None:  # fmt: skip
        check_diloco_options(type(self).__name__, sync_every, outer_lr, outer_momentum)
        super().__init__(precision=precision, timeout=timeout, **options)
        self.sync_every, self.outer_lr, self.outer_momentum = sync_every, outer_lr, outer_momentum
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

    # ---- set-up and heals ---------------------------------------------------------------------
    def _before_start(self, module: nn.Module) -> None:
        self._module = module
        self._names = [n for n, p in module.named_parameters() if p.requires_grad]
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._anchor = [p.detach().clone() for p in self._params]
        self._outer = nesterov_outer(self.outer_lr, self.outer_momentum)(self._anchor)
        self._keep_start()

    def prepare(self, model: nn.Module, optimizer: Any = None, **options: Any) -> Any:  # type: ignore[override]
        wrapped, opt = super().prepare(model, optimizer, **options)
        self._anchor_here()  # the job's first weights (group 0's), or the live ones this group healed to
        return wrapped, opt

    @torch.no_grad()
    def _anchor_here(self) -> None:
        for anchor, p in zip(self._anchor, self._params):
            anchor.copy_(p)

    def _keep_start(self) -> None:
        """Keep the round's start (before its quorum: a heal may be served from then on)."""
        trained = set(self._names)
        self._start_state = _Start(
            buffers={k: v.detach().clone() for k, v in self._module.state_dict().items() if k not in trained},
            optimizer=copy.deepcopy(self._local_optimizer_state(self._optimizer)),
            schedulers=[copy.deepcopy(s.state_dict()) for s in self._schedulers],
        )

    def _heal_state(self, module: nn.Module, inner: torch.optim.Optimizer) -> dict[str, Any]:
        """The round's start, not the live state: the round's steps change that while the heal is served."""
        start, anchors = self._start_state, dict(zip(self._names, self._anchor))
        model = {k: anchors[k] if k in anchors else start.buffers[k] for k in module.state_dict()}
        return {"model": model, "optimizer": start.optimizer, "schedulers": start.schedulers, "history": self._history.state(),
                "clip": self._clip, "resumed": 0, "diloco": {"outer": self._outer.state_dict(), "batches": self._batches}}  # fmt: skip

    def _load_heal(self, module: nn.Module, inner: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
        super()._load_heal(module, inner, saved)
        self._anchor_here()
        self._outer.load_state_dict(saved["diloco"]["outer"])
        self._batches = saved["diloco"]["batches"]

    def _ghost_step(self, started: float) -> None:
        """Take part in a round without data while healing: add zeros to its meeting, take the live state, apply the
        same outer step."""
        tensors = [torch.zeros_like(t) for t in self._meeting_tensors(weight=0.0, length=0)]
        self._sum_across_groups([*tensors, self._history.slots(self.group, self.groups, healing=True)])
        self._heal_applied = self._manager.should_commit()  # loads the live group's round start before deciding
        if self._heal_applied:
            self._history.advance(ft_quorum_id(self._manager))
            self._steps_healed = self._apply_meeting(tensors)
        self._take_schedulers()
        if self._heal_applied:
            self._keeps_live_state = True
            self._events.write("healed", batch=self.committed_batches() - 1, seconds=time.time() - started, dropped=self._dropped)
            self._dropped = 0
        self._keep_start()

    # ---- rounds -------------------------------------------------------------------------------
    def _next_batch(self, end: int) -> int | None:
        """The global batch this step trains: a round's next, or the first of a new round after its quorum."""
        if self._in_step:
            raise RuntimeError(
                "under --groups each batch that distribute() hands out is one optimizer step (its quorum decides its data): "
                "call optimizer.step() for every batch, and accumulate with train_step(accumulate=k), not strategy.accumulate()"
            )
        if self._round is None:
            while True:
                batch = self.committed_batches()
                if batch >= end:
                    return None
                started = time.time()
                self._keep_start()
                self._quorum()
                if ft_healing(self._manager):
                    self._ghost_step(started)
                    continue
                self._round = _Round(batch, min(self.sync_every, end - batch))
                break
        batch = self._round.first + self._round.taken
        self._take_part(batch, time.time())
        return batch

    def _stepping_optimizer(self, inner: torch.optim.Optimizer) -> StrategyOptimizer:
        return _InnerOptimizer(inner, self.precision, self._may_step, self._stepped)

    def _stepped(self) -> None:
        """An inner step applied: the round's last one meets the other groups."""
        self._in_step = False
        self._round.taken += 1
        self.committed = None  # not known before the round's meeting
        if self._round.taken == self._round.length:
            self._meet()

    @torch.no_grad()
    def _meet(self) -> None:
        """Sum the groups' weighted pseudo-gradients and buffers, vote, and apply the outer step or go back to the round's start."""
        r, m = self._round, self.membership
        self._round = None
        tensors = self._meeting_tensors(weight=m.samples / self._global_batch, length=r.length)
        history = self._history.slots(self.group, self.groups)
        self._sum_across_groups([*tensors, history])
        committed = self.committed = self._vote(history)
        if committed:
            self._history.advance(m.quorum_id)
            self._apply_meeting(tensors)
        else:
            self._go_back()
        self._events.write("commit" if committed else "refused", batch=r.first + r.length - 1 if committed else r.first,
                           first=r.first, last=r.first + r.length - 1, groups=list(m.groups))  # fmt: skip

    def _meeting_tensors(self, weight: float, length: int) -> list[torch.Tensor]:
        """What the groups sum at a meeting, flat by dtype: the weighted pseudo-gradients and floating buffers, the
        other buffers as they are, and the round's length (a healing group learns it from the sum)."""
        floating, other = self._buffers()
        values = [(a - p.detach()) * weight for a, p in zip(self._anchor, self._params)] + [b * weight for b in floating] + list(other)
        return [*_flat_by_dtype(values).values(), torch.tensor([float(length)], dtype=torch.float64)]

    def _buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        buffers = list(self._module.buffers())
        return [b for b in buffers if b.is_floating_point()], [b for b in buffers if not b.is_floating_point()]

    @torch.no_grad()
    def _apply_meeting(self, sums: list[torch.Tensor]) -> int:
        """The outer step on the summed pseudo-gradient; the buffers' weighted sum (the others' mean); the job's position
        moves past the round. Returns the round's length."""
        participants = self._manager.num_participants()
        floating, other = self._buffers()
        pseudo = [torch.empty_like(a) for a in self._anchor]
        counted = [torch.empty_like(b) for b in other]
        *flats, length = sums
        _unflat_by_dtype(dict(zip(_flat_by_dtype([*pseudo, *floating, *counted]), flats)), [*pseudo, *floating, *counted])
        for b, total in zip(other, counted):
            b.copy_(total // participants)
        for anchor, grad in zip(self._anchor, pseudo):
            anchor.grad = grad
        self._outer.step()
        self._outer.zero_grad(set_to_none=True)
        for anchor, p in zip(self._anchor, self._params):
            p.copy_(anchor)
        rounds = round(float(length) / participants)
        self._batches += rounds
        return rounds

    @torch.no_grad()
    def _go_back(self) -> None:
        """A round not applied: every group returns to its start, and its batches are trained again."""
        start = self._start_state
        for anchor, p in zip(self._anchor, self._params):
            p.copy_(anchor)
        state = self._module.state_dict()
        for key, value in start.buffers.items():
            state[key].copy_(value)
        self._optimizer.load_state_dict(self._whole_optimizer_state(self._optimizer, copy.deepcopy(start.optimizer)))
        for scheduler, saved in zip(self._schedulers, start.schedulers):
            scheduler.load_state_dict(saved)

    # ---- checkpoints --------------------------------------------------------------------------
    def save(self, directory: Any, *, step: int | None = None, **options: Any) -> Any:  # type: ignore[override]
        """As FT-DDP saves, between rounds only (in a round the groups hold different weights), with the outer momentum."""
        if self._round is not None and self._round.taken:
            raise RuntimeError(
                f"FaultTolerantDiLoCoStrategy saves between rounds, where the groups agree, not {self._round.taken} steps into one: "
                f"save at an epoch's end (fit's checkpoints do) or after a round's last step (every {self.sync_every} batches)"
            )
        return super().save(directory, step=step, **options, **{OUTER: _OuterState(self)})

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
    """The user's optimizer, stepping within the group; after each step the round may meet the other groups."""

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Any, should_step: Callable[[Any], bool], stepped: Callable[[], None]) -> None:
        super().__init__(optimizer, precision, should_step)
        self._stepped = stepped

    @torch.optim.Optimizer.profile_hook_step
    def _update(self, closure: Callable[[], Any] | None) -> Any:
        result = self.precision.step(self.optimizer, closure)
        self._stepped()
        return result

