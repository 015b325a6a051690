"""Synchronous data parallelism: a replica per process, gradients all-reduced in every step.

Built on DistributedDataParallel, which buckets gradients and overlaps their all-reduce with
the rest of the backward pass. How the bytes travel (plain, fp16 or bf16 compressed) is an
argument, kept in ``loom.comm.compression``.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from loom.cluster import ClusterSpec, TorchrunEnvironment
from loom.comm import Connection, compression_hook
from loom.devices import apply_thread_budget, local_device
from loom.errors import ClusterError, LaunchError
from loom.strategies.base import Strategy


class MirroredStrategy(Strategy):
    """All local devices of one machine: every GPU, or on a CPU-only machine N processes.

    Args:
        num_replicas: expected number of replicas; an error if the launch disagrees.
        compression: ``None``, ``"fp16"`` or ``"bf16"`` all-reduce of gradients.
        bucket_cap_mb: DDP bucket size; 25 MB overlaps well from small MLPs to ResNets.
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``.
        timeout: seconds a collective may wait before the job fails naming the missing rank
            (default: ``LOOM_TIMEOUT``, else 300).
        backend: ``"gloo"`` or ``"nccl"``; default from the device.
    """

    def __init__(
        self,
        num_replicas: int | None = None,
        compression: str | None = None,
        bucket_cap_mb: float = 25.0,
        precision: str = "32",
        timeout: float | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__(precision=precision, timeout=timeout)
        if not TorchrunEnvironment.detect():
            raise LaunchError(
                f"{type(self).__name__} runs one process per replica: start the script with "
                "`loom run script.py` or call loom.launch(main) in it"
            )
        self.cluster: ClusterSpec = TorchrunEnvironment.resolve()
        self._check_topology(num_replicas)
        self._hook = compression_hook(compression)
        self.bucket_cap_mb = bucket_cap_mb
        self._device = local_device(self.cluster.local_rank)
        self.threads = apply_thread_budget(self.cluster.local_world_size) if self._device.type == "cpu" else None
        self._ddp: list[DistributedDataParallel] = []
        self._connection = Connection.join(self.cluster, self._device, self.timeout, backend)

    def _check_topology(self, num_replicas: int | None) -> None:
        world = self.cluster.world_size
        if num_replicas is not None and num_replicas != world:
            raise ClusterError(
                f"{type(self).__name__}(num_replicas={num_replicas}) but the job has {world} process(es); "
                f"launch it with {num_replicas} processes or drop num_replicas"
            )
        if self.cluster.nnodes > 1:
            raise ClusterError(
                f"MirroredStrategy is for one machine but this job spans {self.cluster.nnodes} nodes; "
                "use MultiWorkerMirroredStrategy"
            )

    @property
    def num_replicas_in_sync(self) -> int:
        return self.cluster.world_size

    @property
    def replica_id(self) -> int:
        return self.cluster.rank

    @property
    def device(self) -> torch.device:
        return self._device

    def _wrap_model(self, module: nn.Module) -> nn.Module:
        ddp = DistributedDataParallel(
            module,
            device_ids=[self._device] if self._device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=True,
        )
        if self._hook is not None:
            ddp.register_comm_hook(None, self._hook)
        self._ddp.append(ddp)
        return ddp

    def _skip_gradient_sync(self) -> ContextManager[Any]:
        stack = ExitStack()
        for ddp in self._ddp:
            stack.enter_context(ddp.no_sync())
        return stack


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """MirroredStrategy over several machines: every replica on every node, one all-reduce.

    The cluster comes from the launcher (``loom run --nnodes``, TF_CONFIG or Slurm).
    """

    def _check_topology(self, num_replicas: int | None) -> None:
        if num_replicas is not None and num_replicas != self.cluster.world_size:
            super()._check_topology(num_replicas)
