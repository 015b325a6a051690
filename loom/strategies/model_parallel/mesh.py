"""The process grid of the model-parallel strategies: one object, named axes, passed explicitly.

``Mesh({"dp": 2, "tp": 2}, world_size=4)`` checks the degrees and lays the ranks out as
``arange(world).view(*degrees)`` in one fixed axis order, outermost first: ``pp`` (pipeline
stages), ``dp`` (replicas), ``dp_shard`` (replicas that shard parameters, FSDP), ``tp``
(tensor parallel). ``tp`` is innermost so its peers are neighbouring ranks, on one machine's
fast links, as torchtitan lays them out. The data-parallel axes (``dp`` and ``dp_shard``)
together count the replicas: every rank of one replica reads the same batch.

``MeshStrategy`` is the base of the strategies that run on one: it joins the job, builds
torch's ``DeviceMesh`` and combines values over replicas only. ``broadcast_states`` gives every
process rank 0's initial values, as DDP's constructor does.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from loom import comm
from loom.cluster import ClusterSpec, TorchrunEnvironment
from loom.comm import Connection
from loom.devices import apply_thread_budget, local_device
from loom.errors import ClusterError, LaunchError
from loom.strategies.base import Strategy

AXES = ("pp", "dp", "dp_shard", "tp")
DATA_AXES = ("dp", "dp_shard")


class Mesh:
    """Named degrees that multiply to the world size; ``-1`` takes what the others leave."""

    def __init__(self, degrees: Mapping[str, int], world_size: int) -> None:
        unknown = [name for name in degrees if name not in AXES]
        if unknown:
            raise ValueError(f"unknown mesh axis {unknown[0]!r}; name the axes among {', '.join(AXES)}")
        bad = [f"{name}={d!r}" for name, d in degrees.items() if not isinstance(d, int) or isinstance(d, bool) or (d < 1 and d != -1)]
        if bad or list(degrees.values()).count(-1) > 1 or not degrees:
            raise ValueError(
                f"mesh degrees must be positive integers, with at most one -1 for what is left: got {dict(degrees)}"
            )
        known = math.prod(d for d in degrees.values() if d != -1)
        if -1 in degrees.values():
            if world_size % known:
                raise ClusterError(f"mesh {dict(degrees)} cannot fill {world_size} processes: {known} does not divide {world_size}; change the degrees or the number of processes")
            degrees = {name: world_size // known if d == -1 else d for name, d in degrees.items()}
        elif known != world_size:
            raise ClusterError(
                f"mesh {dict(degrees)} needs {known} processes but the job has {world_size}: "
                f"make the degrees multiply to {world_size}, or give one axis -1"
            )
        self.degrees: dict[str, int] = {name: degrees[name] for name in AXES if name in degrees}
        self.world_size = world_size

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.degrees)

    def size(self, axis: str) -> int:
        """The degree of ``axis``; 1 for an axis the mesh does not have."""
        return self.degrees.get(axis, 1)

    def coordinate(self, rank: int, axis: str) -> int:
        """``rank``'s index along ``axis`` (0 for an axis the mesh does not have)."""
        if axis not in self.degrees:
            return 0
        inner = math.prod(d for name, d in self.degrees.items() if AXES.index(name) > AXES.index(axis))
        return rank // inner % self.degrees[axis]

    @property
    def replicas(self) -> int:
        """Replicas whose gradients are combined: the product of the data-parallel axes."""
        return math.prod(self.size(axis) for axis in DATA_AXES)

    def replica_index(self, rank: int) -> int:
        return self.coordinate(rank, "dp") * self.size("dp_shard") + self.coordinate(rank, "dp_shard")

    def replica_groups(self) -> list[list[int]]:
        """Ranks that differ only along the data-parallel axes, one list per model-parallel position."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            place = tuple(self.coordinate(rank, axis) for axis in self.names if axis not in DATA_AXES)
            groups.setdefault(place, []).append(rank)
        return list(groups.values())

    def build(self, device_type: str) -> DeviceMesh:
        """torch's DeviceMesh over the job's processes, its dimensions named as these axes."""
        return init_device_mesh(device_type, tuple(self.degrees.values()), mesh_dim_names=self.names)

    def __repr__(self) -> str:
        return f"Mesh({self.degrees})"


MeshSpec = Union[Mesh, Mapping[str, int]]
BROADCAST_BUCKET = 2**26  # elements: a model is copied a piece at a time, never whole


def broadcast_states(module: nn.Module, device: torch.device) -> None:
    """Rank 0's parameters and buffers on every process of the job, in place, as DDP's constructor does.

    A script that seeds each rank differently (``torch.manual_seed(seed + rank)``, as nanoGPT
    does) builds a different model on each: the layers a plan leaves whole, the replicas and
    the shards cut from them must all start from one model. One broadcast per dtype and
    bucket (``BROADCAST_BUCKET`` elements, as DDP buckets its own), sent from ``device``
    (NCCL sends only from the GPU).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if not tensor.is_meta:  # another pipeline stage's
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        for dtype, tensors in by_dtype.items():
            for bucket in _buckets(tensors):
                flat = torch.cat([t.reshape(-1).to(device) for t in bucket])
                comm.broadcast(flat.view(torch.uint8) if dtype == torch.bool else flat, 0)  # gloo has no bool
                for tensor, value in zip(bucket, flat.split([t.numel() for t in bucket])):
                    tensor.copy_(value.view_as(tensor))


def _buckets(tensors: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        if bucket and size + tensor.numel() > BROADCAST_BUCKET:
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += tensor.numel()
    if bucket:
        yield bucket


class MeshStrategy(Strategy):
    """A strategy whose processes form a ``Mesh``: one replica spans the model-parallel ranks.

    ``reduce`` and ``gather`` combine one value per replica (the model-parallel ranks of a
    replica hold the same batch), and the chief is rank 0.
    """

    def __init__(self, mesh: MeshSpec, precision: str = "32", timeout: float | None = None, backend: str | None = None) -> None:
        super().__init__(precision=precision, timeout=timeout)
        if not TorchrunEnvironment.detect():
            raise LaunchError(
                f"{type(self).__name__} runs one process per device of its mesh: start the script with "
                "`loom run script.py --nproc N` or call loom.launch(main) in it"
            )
        self.cluster: ClusterSpec = TorchrunEnvironment.resolve()
        if isinstance(mesh, Mesh) and mesh.world_size != self.cluster.world_size:
            raise ClusterError(
                f"{mesh} was made for {mesh.world_size} processes but the job has {self.cluster.world_size}"
            )
        self.mesh = self._layout(mesh if isinstance(mesh, Mesh) else Mesh(mesh, self.cluster.world_size))
        self._device = local_device(self.cluster.local_rank)
        self.threads = apply_thread_budget(self.cluster.local_world_size) if self._device.type == "cpu" else None
        self._connection = Connection.join(self.cluster, self._device, self.timeout, backend)
        self.device_mesh: DeviceMesh = self.mesh.build(self._device.type)
        self._replica_group = self._replicas()

    def _layout(self, mesh: Mesh) -> Mesh:
        """The mesh this strategy builds from the user's (checked) one."""
        return mesh

    @property
    def num_replicas_in_sync(self) -> int:
        return self.mesh.replicas

    @property
    def replica_id(self) -> int:
        return self.mesh.replica_index(self.cluster.rank)

    @property
    def is_chief(self) -> bool:
        return self.cluster.rank == 0

    @property
    def model_parallel_degrees(self) -> dict[str, int]:
        kinds = {"pp": "pipeline stage", "tp": "tensor-parallel rank"}
        return {kinds[axis]: self.mesh.size(axis) for axis in kinds if self.mesh.size(axis) > 1}

    @property
    def device(self) -> torch.device:
        return self._device

    def _replicas(self) -> Any:
        """This rank's group of replicas; made at once, since every rank must create every group."""
        if self.mesh.replicas == self.mesh.world_size:
            return None  # the default group
        mine, _ = dist.new_subgroups_by_enumeration(self.mesh.replica_groups())
        return mine

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mesh={self.mesh.degrees}, rank={self.cluster.rank}, device={self.device}, precision={self._precision_name!r})"
