"""Reading DCP checkpoints without running pickled code.

DCP stores its index (``.metadata``) as a pickle and reads it with ``pickle.load``, so a
crafted checkpoint could run code on load. loom reads it with an unpickler that accepts only
the handful of classes that index is made of, then checks that the index is exactly what DCP
writes for tensors: every entry a ``TensorStorageMetadata`` of the exact classes and field
types, every storage entry inside a file that ``COMMITTED`` lists. DCP reads a tensor with
``weights_only=True``, but a *bytes* entry with ``torch.load(weights_only=False)``: loom saves
only tensors through DCP (everything else goes to JSON), so a bytes entry is refused, in the
index and again in the reader. The checked index is the one DCP loads with; the file is not
read twice.

Why not an index of loom's own, in JSON: it would repeat DCP's index and have to agree with
it, and checkpoints already written would still need this reader. The allow-list unpickler
can build nothing but those classes, sizes, dtypes and layouts, and the check below leaves
nothing in them that DCP would read other than as a tensor.
"""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path, PurePath
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType

from loom.checkpoint.checked_read import CheckedBlocks
from loom.checkpoint.layout import BLOCK, MARKER, Manifest
from loom.compat import DCP_INDEX_CLASSES, dcp_index_path, dcp_storage_info
from loom.errors import CheckpointError

_StorageInfo = dcp_storage_info()


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in DCP_INDEX_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of a checkpoint index")


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, given the index ``read_index`` checked. It reads tensors only (DCP reads
    them with ``weights_only=True``), and each from blocks read once and checked against their
    digests before DCP gets a byte of them (``checked_read``)."""

    def __init__(self, path: str | Path, metadata: Metadata, listed: Manifest) -> None:
        super().__init__(path)
        self._metadata = metadata
        self._listed = listed
        self._blocks: CheckedBlocks | None = None
        self._reading: Any = None  # the storage entry DCP reads now

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's reading, in file order, from checked blocks."""
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:  # DCP would torch.load it with weights_only=False
                raise _stored_as_bytes(self, item)
        items = sorted(plan.items, key=lambda item: _place(self.storage_data[item.storage_index]))
        if self._listed.digests is not None:
            self._blocks = CheckedBlocks(self._listed, (block for item in items for block in _as_read(self.storage_data[item.storage_index])))
        try:
            return super().read_data(dataclasses.replace(plan, items=items), planner)
        except CheckpointError:
            raise
        except Exception as error:  # damage explains it best (torch.load loses the error); else name the tensor
            if self._blocks is not None and self._blocks.damaged is not None:
                raise self._blocks.damaged from error
            raise CheckpointError(f"{self._where()} is not a tensor that loads with weights_only=True ({type(error).__name__})") from error
        finally:
            if self._blocks is not None:
                self._blocks.close()

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        """DCP slices each entry's bytes out of its file just before loading them (a private hook:
        should torch rename it, errors name the checkpoint instead of the tensor); here out of checked blocks."""
        self._reading = sinfo
        if self._blocks is None:
            return super()._slice_file(file, sinfo)
        return self._blocks.view(sinfo, super()._slice_file(file, sinfo))

    def _where(self) -> str:
        info = self._reading
        if info is None:
            return f"{self.path}: an entry"
        key = next((i.fqn for i, s in self.storage_data.items() if s is info), "?")
        return f"{Path(self.path) / info.relative_path}: '{key}' (bytes {info.offset}-{info.offset + info.length})"


def _stored_as_bytes(reader: FileSystemReader, item: Any) -> CheckpointError:
    return CheckpointError(f"{index_file(Path(reader.path))}: '{item.storage_index.fqn}' is stored as bytes, which loom never writes: refusing to read it")


def _place(info: Any) -> tuple[str, int]:
    return info.relative_path, info.offset


def _as_read(info: Any) -> list[tuple[str, int]]:
    """The digest blocks a storage entry's bytes lie in, in the order torch.load reads them: the
    last first (the zip's directory, at its end), then from the first on."""
    first, last = info.offset // BLOCK, (info.offset + max(info.length, 1) - 1) // BLOCK
    return [(info.relative_path, block) for block in [last, *range(first, last)]]


@contextmanager
def quiet() -> Iterator[None]:
    """DCP warns when it runs without a process group; for one replica that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def index_file(checkpoint: Path) -> Path:
    """The file of a checkpoint's DCP index."""
    return Path(dcp_index_path(FileSystemReader(checkpoint)))


def load(tensors: dict[str, Any], checkpoint: Path, index: Metadata, listed: Manifest, group: Any = None) -> None:
    """DCP's load of ``tensors`` (in place) from ``checkpoint``, whose ``index`` ``read_index`` checked.

    A failure is one line naming the checkpoint or its file: DCP's own error holds every
    rank's traceback, and it is a BaseException, which ``except Exception`` misses.
    """
    try:
        with quiet():
            reader = SafeFileSystemReader(checkpoint, index, listed)
            dcp.load(tensors, storage_reader=reader, process_group=group, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as error:
        cause = error
        if isinstance(error, CheckpointException) and error.failures:
            cause = error.failures[min(error.failures)][0]  # the first rank's
        if isinstance(cause, CheckpointError):
            raise CheckpointError(str(cause)) from error
        lines = str(cause).strip().splitlines()
        raise CheckpointError(f"{checkpoint}: could not be read ({type(cause).__name__}: {lines[0] if lines else ''})") from error


def read_index(checkpoint: Path, listed: Manifest) -> Metadata:
    """A checkpoint's DCP index, checked to be one loom wrote; an error naming the file (and the key) otherwise.

    ``listed``: the checkpoint's ``COMMITTED``; storage may point only at its files.
    """
    path = index_file(checkpoint)
    if path.name not in listed.sizes:
        raise CheckpointError(f"{path}: not listed in {MARKER}: this is not a complete checkpoint")
    try:
        with open(path, "rb") as file:
            metadata = _IndexUnpickler(file).load()
    except FileNotFoundError as error:
        raise CheckpointError(f"{path}: missing; this is not a complete checkpoint") from error
    except Exception as error:  # truncated or garbage bytes raise many different types
        raise CheckpointError(f"{path}: unreadable checkpoint index ({error})") from error
    if type(metadata) is not Metadata:
        raise CheckpointError(f"{path}: not a checkpoint index (holds a {type(metadata).__name__})")
    _check_index(path, metadata, listed)
    return metadata


# Each class of the index and the fields DCP gives it; an object with any other field is refused.
_FIELDS = {
    Metadata: {"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"},
    TensorStorageMetadata: {"properties", "size", "chunks"},
    TensorProperties: {"dtype", "layout", "requires_grad", "memory_format", "pin_memory"},
    ChunkStorageMetadata: {"offsets", "sizes"},
    MetadataIndex: {"fqn", "offset", "index"},
    _StorageInfo: {"relative_path", "offset", "length", "transform_descriptors"},
    StorageMeta: {"checkpoint_id", "save_id", "load_id", "modules"},
}


def _check_index(path: Path, metadata: Metadata, listed: Manifest) -> None:
    """Refuse, in one line naming the key, anything in the index that DCP would not write for a tensor."""
    _fields(path, metadata, "the index")
    entries = metadata.state_dict_metadata
    if type(entries) is not dict:
        raise CheckpointError(f"{path}: damaged index: its entries are a {type(entries).__name__}, not a dict")
    for key, entry in entries.items():
        _check_entry(path, key, entry)
    storage = metadata.storage_data
    if type(storage) is not dict:
        raise CheckpointError(f"{path}: damaged index: its storage is a {type(storage).__name__}, not a dict")
    for index, info in storage.items():
        _check_storage(path, index, info, entries, listed)
    _check_extras(path, metadata)


def _fields(path: Path, value: Any, where: str) -> None:
    """``value`` is of one of the index's classes, exactly, with every field it needs and no other."""
    allowed = _FIELDS.get(type(value))
    if allowed is None:
        raise CheckpointError(f"{path}: {where} is a {type(value).__name__}, which loom never writes: refusing to read this checkpoint")
    extra = set(vars(value)) - allowed
    missing = {f for f in allowed if f not in vars(value) and not hasattr(type(value), f)}  # a class default stands in
    if extra or missing:
        which = f"with {', '.join(sorted(extra))}" if extra else f"without {', '.join(sorted(missing))}"
        raise CheckpointError(f"{path}: {where} is a {type(value).__name__} {which}, which loom never writes: refusing to read this checkpoint")


def _check_entry(path: Path, key: Any, entry: Any) -> None:
    """A tensor's entry: its exact class, dtype, layout, shape and chunks inside the shape."""
    if type(key) is not str:
        raise CheckpointError(f"{path}: damaged index: a key is a {type(key).__name__}, not a string")
    if type(entry) is not TensorStorageMetadata:
        raise CheckpointError(
            f"{path}: '{key}' is a {type(entry).__name__}, not the TensorStorageMetadata loom writes for a tensor: "
            "refusing to read this checkpoint"
        )
    _fields(path, entry, f"'{key}'")
    props, size, chunks = entry.properties, entry.size, entry.chunks
    _fields(path, props, f"the properties of '{key}'")
    ok = (
        type(props.dtype) is torch.dtype and props.layout is torch.strided and type(props.memory_format) is torch.memory_format
        and type(props.requires_grad) is bool and type(props.pin_memory) is bool
        and _is_shape(size) and type(chunks) is list
    )  # fmt: skip
    if not ok:
        raise CheckpointError(f"{path}: damaged index: the entry of '{key}' has fields of the wrong types")
    for chunk in chunks:
        _fields(path, chunk, f"a chunk of '{key}'")
        if not (_is_shape(chunk.offsets) and _is_shape(chunk.sizes) and len(chunk.offsets) == len(chunk.sizes) == len(size)):
            raise CheckpointError(f"{path}: damaged index: a chunk of '{key}' is not a piece of its {list(size)} shape")
        if any(o + n > whole for o, n, whole in zip(chunk.offsets, chunk.sizes, size)):
            raise CheckpointError(f"{path}: damaged index: a chunk of '{key}' reaches outside its {list(size)} shape")


def _check_storage(path: Path, index: Any, info: Any, entries: dict[str, Any], listed: Manifest) -> None:
    """A storage entry: a tensor's chunk, a byte range inside a file that ``COMMITTED`` lists."""
    _fields(path, index, "a storage key")
    key = index.fqn
    if type(key) is not str or key not in entries:
        raise CheckpointError(f"{path}: damaged index: storage is recorded for {key!r}, which is no tensor of the index")
    if not ((index.offset is None or _is_shape(index.offset)) and (index.index is None or type(index.index) is int)):
        raise CheckpointError(f"{path}: damaged index: the storage key of '{key}' has fields of the wrong types")
    _fields(path, info, f"the storage of '{key}'")
    name, offset, length = info.relative_path, info.offset, info.length
    if type(name) is not str or name not in listed.sizes or name == path.name:
        raise CheckpointError(f"{path}: the storage of '{key}' is {name!r}, which is not a file of this checkpoint: refusing to read it")
    if not (type(offset) is int and type(length) is int and 0 <= offset and 0 <= length and offset + length <= listed.sizes[name]):
        raise CheckpointError(f"{path}: damaged index: the storage of '{key}' lies outside {name} ({listed.sizes[name]} bytes)")
    if info.transform_descriptors:  # DCP's extensions (compression, ...): loom writes none
        raise CheckpointError(f"{path}: the storage of '{key}' is transformed ({info.transform_descriptors}), which loom never writes: refusing to read it")


def _check_extras(path: Path, metadata: Metadata) -> None:
    """The index's other fields: DCP's key mapping, its own version and what it records of the save."""
    mapping = metadata.planner_data
    if mapping is not None and not (
        type(mapping) is dict
        and all(type(k) is str and type(v) is tuple and all(type(p) in (str, int) for p in v) for k, v in mapping.items())
    ):  # fmt: skip
        raise CheckpointError(f"{path}: damaged index: its key mapping is not names to paths")
    if metadata.version is not None and type(metadata.version) is not str:
        raise CheckpointError(f"{path}: damaged index: its version is a {type(metadata.version).__name__}")
    meta = metadata.storage_meta
    if meta is not None:
        _fields(path, meta, "what the index records of the save")
        fine = all(v is None or isinstance(v, (str, PurePath)) for v in (meta.checkpoint_id, meta.save_id, meta.load_id))
        if not (fine and type(meta.modules) is list and all(type(m) is str for m in meta.modules)):
            raise CheckpointError(f"{path}: damaged index: what it records of the save has fields of the wrong types")


def _is_shape(value: Any) -> bool:
    return type(value) is torch.Size and all(type(n) is int and n >= 0 for n in value)
