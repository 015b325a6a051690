"""Values combined over the replicas: one ``reduce`` and one ``gather``, whatever carries them.

A strategy says only how its replicas meet, as a ``Transport``: a process group (every process,
or a hybrid's or a pipeline's data-parallel axis), the parameter servers' meeting point, the
hosts of an XLA job, or no one (a single replica). What the user sees is decided here, once:
the op names (``loom.comm``'s: sum, mean, max, min, product), a Python number comes back as a
number (an int stays an int unless averaged), an integer tensor is averaged in float64, and a
0-d tensor is gathered as one element.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager, Protocol, TypeVar

import torch
import torch.distributed as dist

from loom import comm

Number = TypeVar("Number", int, float)


class Transport(Protocol):
    """How a strategy's replicas exchange a tensor."""

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """``tensor`` combined by ``op`` over every replica (may reuse ``tensor``'s memory)."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every replica's ``tensor`` (at least 1-d) concatenated along dim 0, in replica order."""


class GroupTransport:
    """Replicas that share a ``torch.distributed`` process group (None: the whole job)."""

    def __init__(self, group: dist.ProcessGroup | None = None, guard: Callable[[], ContextManager[None]] = nullcontext) -> None:
        self.group = group
        self.guard = guard  # names a dead rank instead of hanging (the strategy's connection)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        with self.guard():
            return comm.all_reduce(tensor, op, self.group)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.guard():
            return comm.all_gather(tensor, self.group)


class Alone:
    """A single replica: its value is everyone's."""

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()


def reduce(value: torch.Tensor | Number, op: str, transport: Transport, device: torch.device | None = None) -> torch.Tensor | Number:
    """``value`` (a tensor or a Python number) combined by ``op`` over the replicas ``transport`` reaches."""
    comm.check_op(op)
    if isinstance(value, torch.Tensor):
        tensor = value.detach().clone()
        if op == "mean" and not tensor.is_floating_point():
            tensor = tensor.double()
    elif isinstance(value, (int, float)):
        tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
    else:
        raise TypeError(f"reduce() takes a tensor or a number, not {type(value).__name__}")
    result = transport.all_reduce(tensor, op).to(tensor.dtype)
    if isinstance(value, torch.Tensor):
        return result
    number = result.item()
    return int(number) if isinstance(value, int) and op != "mean" else number


def gather(tensor: torch.Tensor, transport: Transport) -> torch.Tensor:
    """Every replica's ``tensor`` concatenated along dim 0 in replica order (a 0-d one as one element)."""
    return transport.all_gather(tensor.reshape(1) if tensor.dim() == 0 else tensor)
