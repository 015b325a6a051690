"""Mixed precision is the strategy's to apply, so the user's loop does not change."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from loom.strategies.optimizer import inner_optimizer
from loom.strategies.outputs import map_outputs

DTYPES: dict[str, torch.dtype | None] = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
KERAS_NAMES = {"float32": "32", "mixed_bfloat16": "bf16-mixed", "mixed_float16": "16-mixed"}  # Keras's policies, same meaning


def canonical(name: str) -> str:
    """loom's name for a precision given by loom's or Keras's name (``"mixed_bfloat16"`` -> ``"bf16-mixed"``)."""
    return KERAS_NAMES.get(name, name)


class GradScaler(torch.amp.GradScaler):
    """torch's GradScaler, made safe for loops that do not follow its recipe to the letter.

    - The scale is updated once per iteration, after every optimizer has stepped (torch's
      recipe). ``step`` only marks the update as due; it runs before the next loss is scaled
      or the state is saved. Updating after each optimizer halved the scale between the first
      optimizer's step and the second's unscale when the first found an inf: the second's
      update came out 2x too large.
    - loom's optimizer wrapper and the optimizer inside it are one optimizer here, so
      ``unscale_(opt)`` before clipping is not repeated by ``opt.step()``.
    """

    def __init__(self, device: str) -> None:
        super().__init__(device)
        self._update_due = False

    def scale(self, outputs: Any) -> Any:  # type: ignore[override]
        self.settle()
        return super().scale(outputs)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(inner_optimizer(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        result = super().step(inner_optimizer(optimizer), *args, **kwargs)
        self._update_due = True
        return result

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        self._update_due = False
        super().update(new_scale)

    def get_scale(self) -> float:
        """The scale the next iteration uses, as torch's gives it right after ``step``: the
        update that is due is worked out on copies, and still runs once, after every optimizer."""
        if not self._update_due or not self._enabled:
            return super().get_scale()
        scale, tracker = self._check_scale_growth_tracker("get_scale")
        scale, tracker = scale.clone(), tracker.clone()
        found = [f.to(scale.device) for state in self._per_optimizer_states.values() for f in state["found_inf_per_device"].values()]
        torch._amp_update_scale_(scale, tracker, sum(found[1:], found[0].clone()), self._growth_factor, self._backoff_factor, self._growth_interval)
        return scale.item()

    def settle(self) -> None:
        """Run the update a finished iteration is owed."""
        if self._update_due:
            self.update()

    def state_dict(self) -> dict[str, Any]:
        self.settle()
        return super().state_dict()


class Precision:
    """Autocast for the forward pass, and a gradient scaler for fp16 (whose range is narrow)."""

    def __init__(self, name: str, device: torch.device) -> None:
        name = canonical(name)
        if name not in DTYPES:
            raise ValueError(f"unknown precision {name!r}; use one of {', '.join(repr(p) for p in DTYPES)}")
        self.name = name
        self.dtype = DTYPES[name]
        self.device_type = device.type
        self.scaler = GradScaler(device.type) if name == "16-mixed" else None

    def autocast(self) -> ContextManager[Any]:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def wrap(self, module: nn.Module) -> nn.Module:
        return module if self.dtype is None else AutocastModule(module, self)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients back to their true size before clipping; once per update, whoever asks."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        """The optimizer's step, through the scaler (skipped when fp16 gradients overflowed)."""
        if self.scaler is None:
            return inner_optimizer(optimizer).step(closure)
        if closure is not None:
            raise ValueError("precision='16-mixed' does not support optimizer closures (e.g. LBFGS); use 'bf16-mixed'")
        return self.scaler.step(optimizer)


class AutocastModule(nn.Module):
    """Runs ``module`` under autocast and hands back fp32 outputs, so the loss is computed in fp32."""

    def __init__(self, module: nn.Module, precision: Precision) -> None:
        super().__init__()
        self.module = module
        self.precision = precision

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast():
            out = self.module(*args, **kwargs)
        return _to_float32(out)


def _to_float32(out: Any) -> Any:
    """Low-precision floating tensors as fp32, in containers of the model's own classes."""
    return map_outputs(_tensor_to_float32, out)


def _tensor_to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:
        return value.float()
    return value
