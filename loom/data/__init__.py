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
from loom.data.streams import TokenStreams, stream_batches

__all__ = [
    "DistributedLoader",
    "Pipeline",
    "PipelineLoader",
    "ReplicaBatchSampler",
    "ShardPlan",
    "Source",
    "TokenStreams",
    "check_global_batch",
    "epoch_order",
    "from_dataset",
    "from_source",
    "from_tensors",
    "image_folder",
    "numpy_files",
    "parquet",
    "stream_batches",
    "to_device",
    "webdataset",
]
