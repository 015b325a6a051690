"""Input: pipelines (sources, parallel map, prefetch), per-replica sharding, loading onto devices."""

from loom.data.loader import DistributedLoader, to_device
from loom.data.pipeline import (
    Pipeline,
    from_dataset,
    from_source,
    from_tensors,
    image_folder,
    numpy_files,
    parquet,
    webdataset,
)
from loom.data.runner import PipelineLoader
from loom.data.sharding import ReplicaBatchSampler, ShardPlan, check_global_batch, epoch_order
from loom.data.sources import Source

__all__ = [
    "DistributedLoader",
    "Pipeline",
    "PipelineLoader",
    "ReplicaBatchSampler",
    "ShardPlan",
    "Source",
    "check_global_batch",
    "epoch_order",
    "from_dataset",
    "from_source",
    "from_tensors",
    "image_folder",
    "numpy_files",
    "parquet",
    "to_device",
    "webdataset",
]
