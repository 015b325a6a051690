"""Reading DCP checkpoints without running pickled code.

DCP stores its index (``.metadata``) as a pickle and reads it with ``pickle.load``, so a
crafted checkpoint could run code on load. loom reads it with an unpickler that accepts only
the handful of classes that index is made of, and saves only tensors through DCP (which reads
them with ``weights_only=True``); everything else goes to JSON.
"""

from __future__ import annotations

import pickle
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from loom.compat import DCP_INDEX_CLASSES, dcp_index_path
from loom.errors import CheckpointError


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in DCP_INDEX_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a checkpoint index")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with an index loaded by an allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = dcp_index_path(self, kwargs.get("rank"))
        metadata = read_index(path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@contextmanager
def quiet() -> Iterator[None]:
    """DCP warns when it runs without a process group; for one replica that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def read_index(path: Any) -> Metadata:
    """A checkpoint's DCP index; a clear error naming the file when it is damaged or not an index."""
    try:
        with open(path, "rb") as file:
            metadata = _IndexUnpickler(file).load()
    except FileNotFoundError as error:
        raise CheckpointError(f"{path}: missing; this is not a complete checkpoint") from error
    except Exception as error:  # truncated or garbage bytes raise many different types
        raise CheckpointError(f"{path}: unreadable checkpoint index ({error})") from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: not a checkpoint index (holds a {type(metadata).__name__})")
    return metadata
