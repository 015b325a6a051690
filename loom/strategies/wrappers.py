"""The wrappers a strategy puts around the user's objects, and the user's objects behind them.

Checkpoints hold the user's own modules and optimizers (so they do not depend on the strategy,
compilation, precision or DDP), and an fp16 optimizer's gradient scaler beside it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from loom.compat import compiled_module_type, compiled_original
from loom.strategies.optimizer import StrategyOptimizer
from loom.strategies.precision import AutocastModule

WRAPPERS: tuple[type[nn.Module], ...] = (DistributedDataParallel, AutocastModule)


SCALER_SUFFIX = ".grad_scaler"  # an fp16 optimizer's GradScaler is saved beside it, as a JSON value


def scaled_optimizers(state: dict[str, Any]) -> dict[str, StrategyOptimizer]:
    """The optimizers whose fp16 gradient scaler belongs in the checkpoint with them."""
    return {name: v for name, v in state.items() if isinstance(v, StrategyOptimizer) and v.scaler is not None}


def unwrapped_state(state: dict[str, Any]) -> dict[str, Any]:
    """The user's own modules and optimizers, so a checkpoint does not depend on the strategy."""
    return {
        name: unwrap(v) if isinstance(v, nn.Module) else v.optimizer if isinstance(v, StrategyOptimizer) else v
        for name, v in state.items()
    }


def unwrap(model: nn.Module) -> nn.Module:
    """The module the user passed to ``prepare``, from whatever wrappers the strategy added.

    Only loom's wrappers and ``torch.compile``'s are peeled: a user's model may well have a
    submodule named ``module``. Checkpoint keys come from the unwrapped module, so they do
    not depend on compilation, precision or DDP.
    """
    compiled = compiled_module_type()
    while isinstance(model, WRAPPERS) or (compiled is not None and isinstance(model, compiled)):
        model = model.module if isinstance(model, WRAPPERS) else compiled_original(model)
    return model
