"""The optimizer ``prepare`` hands back: the user's, stepping through the strategy."""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Iterable

import torch

from loom.compat import leave_step_unwrapped


class StrategyOptimizer(torch.optim.Optimizer):
    """Skips ``step``/``zero_grad`` inside a gradient-accumulation cycle; steps through the precision.

    A torch ``Optimizer`` (its ``__init__`` runs) that owns no state of its own: ``state``,
    ``param_groups`` and ``defaults`` are the wrapped optimizer's very objects, shared again
    whenever it loads a state dict, so LR schedulers and checkpoints see the real thing. Step
    hooks registered on it (``register_step_pre_hook``/``post_hook``) run around each step that
    updates, not around one skipped inside an accumulation cycle. ``precision`` is the
    strategy's ``Precision``: fp16 steps go through its gradient scaler.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, precision: Any, should_step: Callable[[torch.optim.Optimizer], bool] = lambda _: True
    ) -> None:
        super().__init__(optimizer.param_groups, optimizer.defaults)  # torch's hook tables and checks
        self.optimizer = optimizer
        share_state(self, optimizer)
        self.precision = precision
        self._should_step = should_step
        self._held_lrs: list[Any] | None = None  # the learning rates at a step skipped inside this accumulation cycle
        self._warned_schedule = False

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.scaler

    @leave_step_unwrapped
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if not self._step_acts():
            return None
        return self._update(closure)

    @torch.optim.Optimizer.profile_hook_step  # this optimizer's step hooks, around an update only
    def _update(self, closure: Callable[[], Any] | None) -> Any:
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
        self.optimizer.load_state_dict(state_dict)  # shares its new state with this one (share_state)

    def __getattr__(self, name: str) -> Any:
        """The wrapped optimizer's own attributes (an optimizer's extra methods or fields)."""
        if name == "optimizer":  # not set yet: avoid recursing during construction
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"StrategyOptimizer({self.optimizer!r})"


def share_state(wrapper: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> None:
    """Make ``wrapper``'s ``state``, ``param_groups`` and ``defaults`` ``inner``'s objects, now and
    after each ``inner.load_state_dict`` (which binds new ones; DCP's restore calls it on the inner)."""
    ref = weakref.ref(wrapper)

    def share(*_: Any) -> None:
        if (live := ref()) is not None:
            live.state, live.param_groups, live.defaults = inner.state, inner.param_groups, inner.defaults

    share()
    inner.register_load_state_dict_post_hook(share)


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
