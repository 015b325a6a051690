"""Process groups, collectives, failure naming and gradient compression."""

from loom.comm.collectives import (
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    check_op,
    gather,
    rank,
    reduce,
    reduce_scatter,
    scatter,
    world_size,
)
from loom.comm.compression import COMPRESSIONS, PowerSGD, compression_hook
from loom.comm.process_group import Connection, resolve_timeout

__all__ = [
    "COMPRESSIONS",
    "Connection",
    "PowerSGD",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "check_op",
    "compression_hook",
    "gather",
    "rank",
    "reduce",
    "reduce_scatter",
    "resolve_timeout",
    "scatter",
    "world_size",
]
