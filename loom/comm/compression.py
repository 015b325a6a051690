"""Gradient compression for the all-reduce, as DDP communication hooks.

Kept apart from the strategies (like tf.distribute's CrossDeviceOps): a strategy takes the
choice as an argument. Halving the bytes on the wire helps on slow links; each bucket is cast
to the compressed dtype, pre-divided by the group size (so the sum stays in range), reduced,
and cast back into the fp32 gradients before the optimizer sees them.

DDP's own ``bf16_compress_hook`` refuses to run without CUDA and NCCL, although gloo reduces
bf16 on CPU, hence a hook of our own for both dtypes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def cast_allreduce_hook(dtype: torch.dtype) -> Hook:
    """A DDP comm hook that all-reduces each gradient bucket in ``dtype``."""

    def compressed_allreduce(process_group, bucket):  # annotations omitted: DDP checks them literally
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(done: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(decompress)

    return compressed_allreduce


COMPRESSIONS: dict[str, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def compression_hook(name: str | None) -> Hook | None:
    """The DDP comm hook for ``name`` (``None`` for plain fp32 all-reduce)."""
    try:
        dtype = COMPRESSIONS[name or "none"]
    except KeyError:
        raise ValueError(f"unknown gradient compression {name!r}; use one of {', '.join(COMPRESSIONS)}") from None
    return None if dtype is None else cast_allreduce_hook(dtype)
