"""Local SGD's and DiLoCo's collectives: averaging over the replicas, at once or in the background."""

from __future__ import annotations

import torch
import torch.distributed as dist


def average(tensors: list[torch.Tensor]) -> None:
    """Replace each tensor with its mean over the replicas, in one flat all-reduce."""
    if not tensors:
        return
    from torch.distributed.algorithms.model_averaging.utils import average_parameters  # lazy: only when training

    average_parameters(iter(tensors), dist.group.WORLD)


class InFlight:
    """Pseudo-gradients being averaged in the background: one flat all-reduce per dtype, waited for on ``mean``."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.shapes = [t.shape for t in tensors]
        self.dtypes = [t.dtype for t in tensors]
        self.flat = {dtype: torch.cat([t.reshape(-1) for t in tensors if t.dtype == dtype]) for dtype in dict.fromkeys(self.dtypes)}
        self.works = [dist.all_reduce(flat, group=dist.group.WORLD, async_op=True) for flat in self.flat.values()]
        self._mean: list[torch.Tensor] | None = None

    @classmethod
    def arrived(cls, mean: list[torch.Tensor]) -> InFlight:
        """One whose mean is already known (restored from a checkpoint)."""
        done = cls.__new__(cls)
        done._mean = [t.clone() for t in mean]
        return done

    def mean(self) -> list[torch.Tensor]:
        """Waited for once; a save reads it before the sync that applies it."""
        if self._mean is not None:
            return self._mean
        for work in self.works:
            work.wait()
        world = dist.get_world_size()
        offsets = dict.fromkeys(self.flat, 0)
        out = []
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = shape.numel()
            out.append(self.flat[dtype][offsets[dtype]:offsets[dtype] + n].view(shape).div_(world))
            offsets[dtype] += n
        self._mean = out
        return out
