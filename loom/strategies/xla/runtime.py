"""JAX and torchax, imported only when a TPUStrategy is created: ``import loom`` never loads them.

loom runs the user's torch code on its own torchax ``Environment`` (not torchax's global one),
with a few operators replaced. torchax's training-mode batch norm computes the running
statistics and drops them (torchax issue 22), so here they are written back into the
running-stat buffers, with torch's unbiased variance. The compiled step carries those
buffers as state, so BatchNorm trains as in torch. Linear layers and convolutions are routed
to where torchax's autocast casts them, so ``bf16-mixed`` runs them in bfloat16.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from loom.compat import torchax_convolution

EXTRA = "pip install 'loom[xla]' (torch==2.13.0 torchax==0.0.14.dev20261026 jax[cpu]==0.10.2 optax flatbuffers)"


def require() -> Any:
    """The ``jax`` module, or one line naming the extra to install."""
    try:
        import jax
        import torchax  # noqa: F401
    except ImportError as error:
        raise ImportError(f"TPUStrategy needs the xla extra, which is missing ({error.name} not found): {EXTRA}") from None
    return jax


@functools.cache
def environment() -> Any:
    """loom's torchax environment, with batch norm that updates its running statistics."""
    from torchax.tensor import Environment

    env = Environment()
    env.override_op_definition(torch.ops.aten._native_batch_norm_legit.default, _batch_norm)
    env.override_op_definition(torch.ops.aten.native_batch_norm.default, _batch_norm)
    # torchax's autocast casts aten ops; route these two where it sees them, so bf16-mixed reaches them
    env.override_op_definition(torch.nn.functional.linear, lambda x, w, b=None: torch.ops.aten.linear.default(x, w, b))
    env.override_op_definition(torch.ops.aten.convolution.default, functools.partial(_convolution, env))
    return env


def _convolution(env: Any, *args: Any) -> torch.Tensor:
    """torchax's convolution, its inputs in the autocast dtype when there is one (as torch's autocast does)."""
    dtype = env.param.autocast_dtype
    if dtype is not None:
        args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    return env.j2t_iso(torchax_convolution()(*env.t2j_iso(args)))


def _batch_norm(x: torch.Tensor, weight: Any, bias: Any, running_mean: Any, running_var: Any,
                training: bool, momentum: float, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """torch's batch norm in torch ops (run by torchax), updating the running statistics in place."""
    dims = [0, *range(2, x.dim())]
    shape = [1, -1] + [1] * (x.dim() - 2)
    if training:
        mean = x.mean(dims)
        var = ((x - mean.reshape(shape)) ** 2).mean(dims)  # biased, as normalisation uses
        if running_mean is not None:
            n = x.numel() // x.shape[1]
            running_mean.copy_((1 - momentum) * running_mean + momentum * mean.detach())
            running_var.copy_((1 - momentum) * running_var + momentum * var.detach() * (n / max(n - 1, 1)))
    else:
        mean, var = running_mean, running_var
    rstd = torch.rsqrt(var + eps)
    out = (x - mean.reshape(shape)) * rstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out, mean, rstd
