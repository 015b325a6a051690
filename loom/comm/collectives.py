"""The collectives a user may need directly, thin over ``torch.distributed``.

Every function works without an initialised process group (a job of one replica), so code
written against them runs unchanged under OneDeviceStrategy. Ops are named by string:
``"sum" | "mean" | "max" | "min" | "product"``; gloo has no averaging all-reduce, so
``"mean"`` is a sum divided by the group size on every backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


REDUCE_OPS = tuple(_OPS)


def check_op(op: str) -> str:
    """``op`` if it names a reduction, else the one-line error every reduce in loom raises."""
    if op not in _OPS:
        raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(_OPS)}")
    return op


def _op(op: str) -> dist.ReduceOp:
    return _OPS[check_op(op)]


def _finish_mean(tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None) -> torch.Tensor:
    if op == "mean":
        tensor.div_(world_size(group))
    return tensor


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over the group, in place on every rank; returns it."""
    if world_size(group) > 1:
        dist.all_reduce(tensor, _op(op), group=group)
    else:
        _op(op)
    return _finish_mean(tensor, op, group)


def reduce(tensor: torch.Tensor, dst: int = 0, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce onto rank ``dst`` (in place there); other ranks' tensors are left unspecified."""
    if world_size(group) > 1:
        dist.reduce(tensor, dst, _op(op), group=group)
    else:
        _op(op)
    return _finish_mean(tensor, op, group) if rank(group) == dst else tensor


def broadcast(tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Copy rank ``src``'s tensor into every rank's ``tensor``; returns it."""
    if world_size(group) > 1:
        dist.broadcast(tensor, src, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0, in rank order; dim 0 may differ per rank."""
    n = world_size(group)
    if n == 1:
        return tensor
    tensor = tensor.contiguous()
    sizes = torch.tensor([tensor.shape[0]], device=tensor.device)
    all_sizes = [torch.empty_like(sizes) for _ in range(n)]
    dist.all_gather(all_sizes, sizes, group=group)
    lengths = [int(s) for s in all_sizes]
    longest = max(lengths)
    padded = tensor
    if tensor.shape[0] < longest:  # all_gather needs equal shapes: pad, then trim
        padded = torch.cat([tensor, tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))])
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:length] for p, length in zip(parts, lengths)])


def gather(tensor: torch.Tensor, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[torch.Tensor] | None:
    """Every rank's tensor (same shape everywhere), as a list on ``dst``; ``None`` elsewhere."""
    if world_size(group) == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(world_size(group))] if rank(group) == dst else None
    dist.gather(tensor.contiguous(), parts, dst=dst, group=group)
    return parts


def scatter(
    out: torch.Tensor, chunks: list[torch.Tensor] | None = None, src: int = 0, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Rank ``src`` sends ``chunks[i]`` to rank i, which receives it into ``out``; returns ``out``."""
    if world_size(group) == 1:
        return out.copy_(chunks[0]) if chunks is not None else out
    dist.scatter(out, chunks if rank(group) == src else None, src=src, group=group)
    return out


def reduce_scatter(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over the group and return this rank's dim-0 chunk of the result.

    ``tensor.shape[0]`` must be divisible by the group size.
    """
    n = world_size(group)
    if tensor.shape[0] % n:
        raise ValueError(f"reduce_scatter needs dim 0 ({tensor.shape[0]}) divisible by the group size ({n})")
    out = tensor.new_empty((tensor.shape[0] // n, *tensor.shape[1:]))
    if n == 1:
        out.copy_(tensor)
        _op(op)
    else:
        dist.reduce_scatter_tensor(out, tensor.contiguous(), _op(op), group=group)
    return _finish_mean(out, op, group)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of the group reaches this point."""
    if world_size(group) > 1:
        dist.barrier(group=group)
