"""Mixed precision is the strategy's to apply, so the user's loop does not change."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, ContextManager

import torch
from torch import nn

DTYPES: dict[str, torch.dtype | None] = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class Precision:
    """Autocast for the forward pass, and a gradient scaler for fp16 (whose range is narrow)."""

    def __init__(self, name: str, device: torch.device) -> None:
        if name not in DTYPES:
            raise ValueError(f"unknown precision {name!r}; use one of {', '.join(repr(p) for p in DTYPES)}")
        self.name = name
        self.dtype = DTYPES[name]
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type) if name == "16-mixed" else None

    def autocast(self) -> ContextManager[Any]:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def wrap(self, module: nn.Module) -> nn.Module:
        return module if self.dtype is None else AutocastModule(module, self)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)


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
    if isinstance(out, torch.Tensor):
        return out.float() if out.is_floating_point() and out.dtype != torch.float64 else out
    if isinstance(out, (list, tuple)):
        return type(out)(_to_float32(o) for o in out)
    if isinstance(out, dict):
        return {k: _to_float32(v) for k, v in out.items()}
    return out
