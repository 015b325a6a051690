"""ShardedStrategy within each replica group, replicated across groups by torchft: FT-HSDP.

The replica-group machinery is FaultTolerantMirroredStrategy's (``data_parallel.fault_tolerant``):
the quorum, the split of each global batch, the commit vote, healing. What differs is that each
of a group's N processes holds only its shard of every parameter, gradient and optimizer state
(FSDP2): process r sums its gradient shard with process r of the other groups, with nothing to
gather after, and heals from process r of a live group. A separate module, as ShardedStrategy
is: DTensor and FSDP2 load on first use.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from loom.strategies.data_parallel.fault_tolerant import _AcrossGroups
from loom.strategies.model_parallel.sharded import ShardedStrategy


class FaultTolerantShardedStrategy(_AcrossGroups, ShardedStrategy):
    """ShardedStrategy (FSDP2, ZeRO-3) within each replica group, torchft's fault-tolerant all-reduce across groups (FT-HSDP).

    For a model whose parameters, gradients and optimizer state do not fit in one process, on
    machines that fail: a group of N processes holds one copy, sharded N ways. Every group has
    the same N (``loom run --groups G --nproc N``).

    Args:
        precision: ``"32"`` or ``"bf16-mixed"`` (fp16's loss scale is not healed, so it is refused).
        timeout: seconds a collective or a quorum may wait (default: ``LOOM_TIMEOUT``, else 300).
        **options: ShardedStrategy's options (``wrap``, ``reshard_after_forward``, ...) for the processes
            of a group (not ``sync_batchnorm``: it would sync within a group only).
    """

    shards_gradients = True

    @staticmethod
    def _local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    @staticmethod
    def _shard_like(param: torch.Tensor, local: torch.Tensor, layout: Any = None) -> torch.Tensor:
        if not isinstance(param, DTensor):
            return local
        placements, shape, stride = layout or (param.placements, param.shape, param.stride())  # an optimizer state may differ from its parameter
        return DTensor.from_local(local, param.device_mesh, placements, shape=torch.Size(shape), stride=tuple(stride))

    @staticmethod
    def _layout(tensor: torch.Tensor) -> Any:
        return (tuple(tensor.placements), tuple(tensor.shape), tuple(tensor.stride())) if isinstance(tensor, DTensor) else None
