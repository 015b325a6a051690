"""Gradient compression for the all-reduce, as DDP communication hooks.

Kept apart from the strategies (like tf.distribute's CrossDeviceOps): a strategy takes the
choice as an argument. Halving the bytes on the wire helps on slow links; the gradients are
cast back to their own dtype before the optimizer sees them.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

COMPRESSIONS: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


def compression_hook(name: str | None) -> Callable[..., Any] | None:
    """The DDP comm hook for ``name`` (``None`` for plain fp32 all-reduce)."""
    try:
        return COMPRESSIONS[name or "none"]
    except KeyError:
        raise ValueError(f"unknown gradient compression {name!r}; use one of {', '.join(COMPRESSIONS)}") from None
