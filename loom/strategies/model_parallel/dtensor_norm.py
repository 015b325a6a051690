"""The global norm of gradients that are split over ranks (DTensor shards), and clipping to it.

``torch.nn.utils.clip_grad_norm_`` is right only when every gradient lives on one mesh and
every rank holds all of them; with tensors on several meshes (tensor parallel beside FSDP),
or parameters spread over pipeline stages, its norm is wrong. Here each rank sums ``|g|^p``
over its local shards, then adds the partial sums over exactly the mesh dimensions a tensor
is sharded on (never over replicated ones, which would count a value twice), and
``groups`` adds what other ranks hold outright (the other pipeline stages). It is the one
global norm of loom: the pipeline's norm over its stages is this with ``groups=(pp group,)``.
DTensor is not imported here (a second of CPU): a gradient can be one only once it is loaded.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

PENDING = tuple[dist.ProcessGroup, ...]


def global_norm(tensors: Iterable[torch.Tensor], norm_type: float = 2.0, groups: Sequence[dist.ProcessGroup] = ()) -> torch.Tensor:
    """The ``norm_type`` norm of all ``tensors`` as one vector, equal on every rank (a 0-d tensor).

    Every rank of a mesh must pass its tensors in the same order (the parameters' order).
    """
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"norm_type must be positive or inf, got {norm_type!r}")
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    partial: dict[PENDING, torch.Tensor] = {}  # by the process groups a partial sum still needs
    device = None
    dtensor = _dtensor_type()
    for tensor in tensors:
        if dtensor is not None and isinstance(tensor, dtensor):
            tensor = _without_partial(tensor)
            reduce_over = tuple(tensor.device_mesh.get_group(d) for d, pl in enumerate(tensor.placements) if not pl.is_replicate())  # Shard and FSDP-over-TP's _StridedShard
            local = tensor.to_local()
        else:
            reduce_over, local = (), tensor
        device = local.device
        part = _local_part(local.detach(), p)
        partial[reduce_over] = part if reduce_over not in partial else _combine(partial[reduce_over], part, p)
    if device is None:  # nothing here; other stages may still hold gradients
        device = torch.device("cuda", torch.cuda.current_device()) if _on_cuda(groups) else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for reduce_over, part in partial.items():
        for group in reduce_over:
            dist.all_reduce(part, op=op, group=group)
        total = _combine(total, part.to(device), p)
    for group in groups:
        dist.all_reduce(total, op=op, group=group)
    return total if math.isinf(p) else total ** (1.0 / p)


def clip_grad_norm(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, groups: Sequence[dist.ProcessGroup] = ()
) -> torch.Tensor:
    """Scale the gradients so that their global norm is at most ``max_norm``; returns the norm before.

    The same coefficient as ``clip_grad_norm_`` (``max_norm / (norm + 1e-6)``, at most 1), so
    one device and many give the same update.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total = global_norm(grads, norm_type, groups)
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    dtensor = _dtensor_type()
    with torch.no_grad():
        for grad in grads:
            local = grad.to_local() if dtensor is not None and isinstance(grad, dtensor) else grad
            local.mul_(coefficient.to(local.device, local.dtype))
    return total


def _local_part(local: torch.Tensor, p: float) -> torch.Tensor:
    """``sum |x|^p`` (``max |x|`` for inf) of one local tensor, in fp32 or wider."""
    dtype = torch.float64 if local.dtype == torch.float64 else torch.float32
    if local.numel() == 0:
        return torch.zeros((), dtype=dtype, device=local.device)
    norm = torch.linalg.vector_norm(local, p, dtype=dtype)
    return norm if math.isinf(p) else norm**p


def _combine(a: torch.Tensor, b: torch.Tensor, p: float) -> torch.Tensor:
    return torch.maximum(a, b) if math.isinf(p) else a + b


def _dtensor_type() -> type | None:
    """DTensor's class once its module is loaded (no tensor is a DTensor before)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _without_partial(tensor: Any) -> Any:
    """A gradient still pending a sum (``Partial``) is summed first: its norm is not the parts' norms."""
    if not any(pl.is_partial() for pl in tensor.placements):
        return tensor
    from torch.distributed.tensor import Replicate

    return tensor.redistribute(tensor.device_mesh, [Replicate() if pl.is_partial() else pl for pl in tensor.placements])


def _on_cuda(groups: Sequence[dist.ProcessGroup]) -> bool:
    return bool(groups) and dist.get_backend(groups[0]) == "nccl"
