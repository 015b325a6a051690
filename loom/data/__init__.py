"""Input: per-replica sharding of global batches and loading onto the replica's device."""

from loom.data.loader import DistributedLoader, to_device
from loom.data.sharding import ReplicaBatchSampler, ShardPlan, check_global_batch, epoch_order

__all__ = ["DistributedLoader", "ReplicaBatchSampler", "ShardPlan", "check_global_batch", "epoch_order", "to_device"]
