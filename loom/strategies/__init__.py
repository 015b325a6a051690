"""One module per strategy; ``get_strategy`` finds one by name."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from loom.cluster import TorchrunEnvironment
from loom.comm.groups import in_groups
from loom.strategies.base import Strategy, unwrap
from loom.strategies.data_parallel.fault_tolerant import FaultTolerantMirroredStrategy
from loom.strategies.data_parallel.fault_tolerant_diloco import FaultTolerantDiLoCoStrategy
from loom.strategies.data_parallel.local_sgd import DiLoCoStrategy, LocalSGDStrategy
from loom.strategies.model_parallel.mesh import Mesh
from loom.strategies.data_parallel.mirrored import MirroredStrategy, MultiWorkerMirroredStrategy
from loom.strategies.data_parallel.one_device import OneDeviceStrategy
from loom.strategies.model_parallel.pipeline.strategy import PipelineStrategy
from loom.strategies.xla import TPUStrategy  # imports JAX only when one is created

if TYPE_CHECKING:
    from loom.strategies.model_parallel.hybrid import HybridStrategy
    from loom.strategies.parameter_server.coordinator import ClusterCoordinator, RemoteValue
    from loom.strategies.parameter_server.strategy import ParameterServerStrategy
    from loom.strategies.model_parallel.fault_tolerant_sharded import FaultTolerantShardedStrategy
    from loom.strategies.model_parallel.sharded import ShardedStrategy
    from loom.strategies.model_parallel.tensor_parallel import TensorParallelStrategy

# The strategies built on DTensor and FSDP2 load on first use: importing those costs about a
# second of CPU, which every launcher and every data-parallel or parameter-server process would pay.
# So do the parameter servers (gRPC: a sixth of a second in every process that never uses them).
ON_FIRST_USE = {
    "ParameterServerStrategy": "loom.strategies.parameter_server.strategy",
    "ClusterCoordinator": "loom.strategies.parameter_server.coordinator",
    "RemoteValue": "loom.strategies.parameter_server.coordinator",
    "ShardedStrategy": "loom.strategies.model_parallel.sharded",
    "FaultTolerantShardedStrategy": "loom.strategies.model_parallel.fault_tolerant_sharded",
    "TensorParallelStrategy": "loom.strategies.model_parallel.tensor_parallel",
    "HybridStrategy": "loom.strategies.model_parallel.hybrid",
}


def __getattr__(name: str) -> Any:
    if name in ON_FIRST_USE:
        return getattr(importlib.import_module(ON_FIRST_USE[name]), name)
    raise AttributeError(f"module 'loom.strategies' has no attribute {name!r}")


STRATEGIES: dict[str, type[Strategy] | str] = {  # a class, or the name of one loaded on first use
    "one_device": OneDeviceStrategy,
    "mirrored": MirroredStrategy,
    "multi_worker_mirrored": MultiWorkerMirroredStrategy,
    "parameter_server": "ParameterServerStrategy",
    "sharded": "ShardedStrategy",
    "pipeline": PipelineStrategy,
    "tensor_parallel": "TensorParallelStrategy",
    "hybrid": "HybridStrategy",
    "tpu": TPUStrategy,
    "xla": TPUStrategy,
    "local_sgd": LocalSGDStrategy,
    "diloco": DiLoCoStrategy,
    "fault_tolerant": FaultTolerantMirroredStrategy,
    "fault_tolerant_sharded": "FaultTolerantShardedStrategy",
    "fault_tolerant_diloco": FaultTolerantDiLoCoStrategy,
}


def get_strategy(name: str, **options: Any) -> Strategy:
    """Build a strategy by its registered name, e.g. ``get_strategy("mirrored", precision="bf16-mixed")``."""
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}") from None
    return (__getattr__(cls) if isinstance(cls, str) else cls)(**options)


def auto_strategy(**options: Any) -> Strategy:
    """What a job started this way needs: one device alone, Mirrored on one node, else multi-worker.

    A worker that ``loom run --ps N --workers M`` started gets ParameterServerStrategy; one that
    ``loom run --groups G`` started, FaultTolerantMirroredStrategy.
    """
    if os.environ.get("LOOM_PS_SERVERS"):
        return __getattr__("ParameterServerStrategy")(**options)
    if in_groups():
        return FaultTolerantMirroredStrategy(**options)
    if not TorchrunEnvironment.detect() or TorchrunEnvironment.resolve().world_size == 1:
        return OneDeviceStrategy(**options)
    if TorchrunEnvironment.resolve().nnodes == 1:
        return MirroredStrategy(**options)
    return MultiWorkerMirroredStrategy(**options)


__all__ = [
    "STRATEGIES",
    "ClusterCoordinator",
    "DiLoCoStrategy",
    "FaultTolerantDiLoCoStrategy",
    "FaultTolerantMirroredStrategy",
    "FaultTolerantShardedStrategy",
    "HybridStrategy",
    "LocalSGDStrategy",
    "Mesh",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PipelineStrategy",
    "RemoteValue",
    "ShardedStrategy",
    "Strategy",
    "TensorParallelStrategy",
    "TPUStrategy",
    "auto_strategy",
    "get_strategy",
    "unwrap",
]
