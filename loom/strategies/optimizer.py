"""The optimizer ``prepare`` hands back: the user's, stepping through the strategy."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch


class StrategyOptimizer(torch.optim.Optimizer):
    """Skips ``step``/``zero_grad`` inside a gradient-accumulation cycle; steps through the precision.

    It owns no state: ``state`` and ``param_groups`` are the wrapped optimizer's, so LR
    schedulers (which need an ``Optimizer``) and checkpoints see the real thing. It subclasses
    ``Optimizer`` for those isinstance checks and deliberately skips its ``__init__``.
    ``precision`` is the strategy's ``Precision``: fp16 steps go through its gradient scaler.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, precision: Any, should_step: Callable[[torch.optim.Optimizer], bool] = lambda _: True
    ) -> None:
        self.optimizer = optimizer
        self.precision = precision
        self._should_step = should_step
        self._held_lrs: list[Any] | None = None  # the learning rates at a step skipped inside this accumulation cycle
        self._warned_schedule = False

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.scaler

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if not self._step_acts():
            return None
        return self.precision.step(self.optimizer, closure)

    def _step_acts(self) -> bool:
        """Whether this ``step()`` updates (not inside an accumulation cycle); watches the schedule."""
        acts = self._should_step(self)
        self._watch_schedule(acts)
        return acts

    def _watch_schedule(self, acts: bool) -> None:
        """Warn once when the learning rate moves inside an accumulation cycle: a scheduler stepped
        every micro-batch runs its schedule k times too fast."""
        if acts and self._held_lrs is None:  # outside a cycle: nothing to compare
            return
        lrs = [float(group["lr"]) if "lr" in group else None for group in self.param_groups]
        if self._held_lrs is not None and lrs != self._held_lrs and not self._warned_schedule:
            self._warned_schedule = True
            warnings.warn(
                "the learning rate changed inside an accumulate() cycle, so the LR scheduler steps every micro-batch "
                "and runs its schedule that many times too fast: step it only when strategy.sync_gradients is True",
                stacklevel=4,
            )
        self._held_lrs = None if acts else lrs

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._should_step(self):
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # not set yet: avoid recursing during construction
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"StrategyOptimizer({self.optimizer!r})"


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The user's optimizer, from loom's wrapper or as it is."""
    return optimizer.optimizer if isinstance(optimizer, StrategyOptimizer) else optimizer


def check_owned(optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor]) -> None:
    """Refuse an optimizer built on other tensors than the model's ``parameters``: it would step
    tensors the strategy never syncs (nor places, shards or splits)."""
    owned = {id(p) for p in parameters}
    if not all(id(p) in owned for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "the optimizer holds parameters that are not the model's; build it on this model's parameters, "
            "or pass a factory: prepare(model, lambda params: torch.optim.SGD(params, lr=0.1))"
        )
