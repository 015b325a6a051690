"""loom: scale a plain PyTorch training script by swapping one object, the strategy."""

from loom import comm
from loom.cluster import ClusterSpec, NodeSpec
from loom.errors import ClusterError, LaunchError, LoomError, RankFailureError
from loom import strategies
from loom.launch import launch
from loom.strategies import (
    DiLoCoStrategy,
    FaultTolerantDiLoCoStrategy,
    FaultTolerantMirroredStrategy,
    LocalSGDStrategy,
    Mesh,
    MirroredStrategy,
    MultiWorkerMirroredStrategy,
    OneDeviceStrategy,
    PipelineStrategy,
    Strategy,
    TPUStrategy,
    auto_strategy,
    get_strategy,
    unwrap,
)
from loom.strategies.tf_compat import InputContext, ReduceOp, compute_average_loss
from loom.train import Callback, EarlyStopping, TensorBoard, evaluate, fit, predict
from loom.train.export import export

__version__ = "0.1.0"

__all__ = [
    "Callback",
    "ClusterCoordinator",
    "ClusterError",
    "ClusterSpec",
    "DiLoCoStrategy",
    "EarlyStopping",
    "FaultTolerantDiLoCoStrategy",
    "FaultTolerantMirroredStrategy",
    "FaultTolerantShardedStrategy",
    "HybridStrategy",
    "InputContext",
    "LaunchError",
    "LocalSGDStrategy",
    "LoomError",
    "Mesh",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NodeSpec",
    "OneDeviceStrategy",
    "ParameterServerStrategy",
    "PipelineStrategy",
    "ReduceOp",
    "RankFailureError",
    "RemoteValue",
    "ShardedStrategy",
    "Strategy",
    "TensorBoard",
    "TensorParallelStrategy",
    "TPUStrategy",
    "advise",
    "auto_strategy",
    "comm",
    "compute_average_loss",
    "evaluate",
    "export",
    "fit",
    "get_strategy",
    "launch",
    "predict",
    "unwrap",
]


def __getattr__(name: str):
    """``loom.advise``, the strategies on DTensor/FSDP2 and the parameter servers are imported on first use,
    to keep ``import loom`` light."""
    if name == "advise":
        from loom.diagnostics.advise import advise

        return advise
    if name in strategies.ON_FIRST_USE:
        return getattr(strategies, name)
    raise AttributeError(f"module 'loom' has no attribute {name!r}")
