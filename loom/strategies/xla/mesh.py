"""The device mesh and where each array lives on it, as named shardings.

A mesh has a ``data`` axis (the batch is split over it) and a ``model`` axis (large weights
are split over it). ``{"data": 8}`` is pure data parallelism; ``{"data": 4, "model": 2}`` is
the XLA form of the hybrid strategy: XLA's partitioner inserts the collectives each layout
needs (an all-reduce of gradients over ``data``, gathers over ``model``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AXES = ("data", "model")


@dataclass
class MeshPlan:
    """The mesh and the rules that place batches, parameters and optimizer state on it."""

    mesh: Any
    shard_threshold: int

    @property
    def data_size(self) -> int:
        return self.mesh.shape["data"]

    @property
    def model_size(self) -> int:
        return self.mesh.shape["model"]

    def batch(self) -> Any:
        """Samples split over ``data``; every other dimension whole."""
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec("data"))

    def replicated(self) -> Any:
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.mesh, PartitionSpec())

    def parameter(self, shape: tuple[int, ...]) -> Any:
        """Split over ``model`` along the largest dimension it divides, for weights of at least
        ``shard_threshold`` elements; replicated otherwise."""
        from jax.sharding import NamedSharding, PartitionSpec

        size = 1
        for d in shape:
            size *= d
        if self.model_size == 1 or size < self.shard_threshold:
            return self.replicated()
        dims = [i for i, d in enumerate(shape) if d % self.model_size == 0]
        if not dims:
            return self.replicated()
        dim = max(dims, key=lambda i: shape[i])
        return NamedSharding(self.mesh, PartitionSpec(*[("model" if i == dim else None) for i in range(len(shape))]))


def build_mesh(jax: Any, mesh: dict[str, int] | None, shard_threshold: int) -> MeshPlan:
    """All devices JAX sees (every host's), laid out as ``mesh``; one clear line when they do not fit."""
    devices = jax.devices()
    shape = dict(mesh or {"data": len(devices)})
    unknown = set(shape) - set(AXES)
    if unknown:
        raise ValueError(f"TPUStrategy(mesh=...) takes the axes 'data' and 'model', not {', '.join(sorted(unknown))}")
    shape.setdefault("data", 1)
    shape.setdefault("model", 1)
    if any(not isinstance(n, int) or n < 1 for n in shape.values()):
        raise ValueError(f"TPUStrategy(mesh={mesh}): every axis needs a positive number of devices")
    if shape["data"] * shape["model"] != len(devices):
        raise ValueError(
            f"TPUStrategy(mesh={mesh}) needs {shape['data'] * shape['model']} devices but JAX sees {len(devices)} "
            f"({devices[0].platform}); make data x model equal {len(devices)}"
        )
    import numpy as np
    from jax.sharding import Mesh

    grid = np.array(devices).reshape(shape["data"], shape["model"])
    return MeshPlan(Mesh(grid, AXES), shard_threshold)
