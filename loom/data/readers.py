"""Sources that read files: Parquet, WebDataset tars, image folders and NumPy arrays.

Each reader counts a shard's elements from metadata alone (Parquet footers, tar headers, npy
headers, a directory listing), so an epoch is planned without decoding anything, and reads one
element on demand from any thread of any worker process. Open files and decoded data live in a
per-process cache (an ``_open`` attribute, so it is neither pickled nor shared across a fork),
and every failure to read a file is a DataFileError naming it, which ``errors='skip'`` can skip.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import itertools
import json
import os
import posixpath
import tarfile
import threading
import zipfile
from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from loom.data.sources import Source, expand_files
from loom.errors import DataFileError

Files = str | os.PathLike | Iterable[str | os.PathLike]
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def decode_image(data: bytes, path: str = "<bytes>") -> torch.Tensor:
    """Encoded image bytes as a uint8 CHW RGB tensor; undecodable data is a DataFileError."""
    try:
        return _rgb_chw(data)
    except Exception as error:  # Pillow raises many types (OSError, SyntaxError, zlib.error...)
        raise DataFileError(path, f"cannot decode image ({error})") from error


class ParquetSource(Source):
    """Rows of Parquet files as ``{column: value}``, one shard per file.

    Row groups are decoded whole on first use and kept in a small LRU cache, so reading rows in
    (nearly) sequential order decodes each row group once per process.
    """

    def __init__(self, files: Files, columns: Sequence[str] | None = None, errors: str = "raise") -> None:
        super().__init__(expand_files(files, "Parquet files", errors), errors)
        self.columns = list(columns) if columns is not None else None
        self._row_starts: dict[int, list[int]] = {}  # shard -> first row of each row group, then num_rows

    def shard_length(self, shard: int) -> int:
        return self._starts(shard)[-1]

    def read(self, shard: int, index: int) -> dict[str, Any]:
        starts = self._starts(shard)
        if not 0 <= index < starts[-1]:
            raise IndexError(f"row {index} out of range for {self.shards[shard]} ({starts[-1]} rows)")
        group = bisect.bisect_right(starts, index) - 1
        values = _cache(self, 8).get((shard, group), lambda: self._decode(shard, group))
        return {name: column[index - starts[group]] for name, column in values.items()}

    def _starts(self, shard: int) -> list[int]:
        starts = self._row_starts.get(shard)
        if starts is None:
            import pyarrow as pa
            import pyarrow.parquet as pq

            path = self.shards[shard]
            with _reading(path, "not a readable Parquet file", pa.ArrowException), pq.ParquetFile(path) as file:
                names = file.schema_arrow.names
                sizes = [file.metadata.row_group(g).num_rows for g in range(file.num_row_groups)]
            missing = [c for c in self.columns or () if c not in names]
            if missing:
                raise DataFileError(path, f"has no column {missing[0]!r} (its columns: {', '.join(names)})")
            starts = self._row_starts[shard] = list(itertools.accumulate(sizes, initial=0))
        return starts

    def _decode(self, shard: int, group: int) -> dict[str, np.ndarray | list]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.shards[shard]
        with _reading(path, f"cannot decode row group {group}", pa.ArrowException), pq.ParquetFile(path) as file:
            table = file.read_row_group(group, columns=self.columns)
            return {name: _column_values(column) for name, column in zip(table.column_names, table.columns)}


class WebDatasetSource(Source):
    """Samples of uncompressed WebDataset tars as ``{"__key__": key, ext: value}``, one shard per tar.

    Consecutive members ``key.ext`` with the same key form a sample. Counting reads only the tar
    headers; reading fetches each member's bytes with ``os.pread`` (no shared file position).
    With ``decode``, images become uint8 CHW tensors, cls/index ints, txt str, json its value and
    npy a tensor; other extensions stay bytes.
    """

    def __init__(self, files: Files, errors: str = "raise", decode: bool = True) -> None:
        super().__init__(expand_files(files, "tar shards", errors), errors)
        self.decode = decode
        self._samples: dict[int, list[tuple[str, dict[str, tuple[int, int]]]]] = {}  # shard -> index

    def shard_length(self, shard: int) -> int:
        return len(self._index(shard))

    def read(self, shard: int, index: int) -> dict[str, Any]:
        path = self.shards[shard]
        key, members = self._index(shard)[index]
        with _reading(path, "cannot open"):
            file = _cache(self, 32).get(shard, lambda: open(path, "rb"))
        sample: dict[str, Any] = {"__key__": key}
        for ext, (offset, size) in members.items():
            with _reading(path, f"cannot read member {key}.{ext}"):
                data = os.pread(file.fileno(), size, offset)
            if len(data) != size:
                raise DataFileError(path, f"truncated: member {key}.{ext} ends past the end of the file")
            try:
                sample[ext] = _decode_member(ext, data) if self.decode else data
            except Exception as error:  # whatever the decoder raises, the member is bad
                raise DataFileError(path, f"cannot decode member {key}.{ext} ({error})") from error
        return sample

    def _index(self, shard: int) -> list[tuple[str, dict[str, tuple[int, int]]]]:
        samples = self._samples.get(shard)
        if samples is None:
            samples = self._samples[shard] = _tar_index(self.shards[shard])
        return samples


class ImageFolderSource(Source):
    """``(image, label)`` pairs of a ``root/<class>/<image>`` folder (the torchvision ImageFolder layout).

    One shard holding every image, sorted; ``classes`` are the sorted class folders and a label
    is an index into it. With ``decode=False`` the image is the file's bytes, for a map to decode.
    """

    auto_shard = "sample"

    def __init__(
        self,
        root: str | os.PathLike,
        extensions: Sequence[str] = IMAGE_EXTENSIONS,
        decode: bool = True,
        errors: str = "raise",
    ) -> None:
        root = os.fspath(root)
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{root}: no such image folder")
        super().__init__([root], errors)
        self.decode = decode
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        suffixes = tuple(e.lower() for e in extensions)
        self.samples: list[tuple[str, int]] = []
        for label, name in enumerate(self.classes):
            for directory, _, names in sorted(os.walk(os.path.join(root, name), followlinks=True)):
                images = sorted(n for n in names if n.lower().endswith(suffixes))
                self.samples += [(os.path.join(directory, n), label) for n in images]
        if not self.samples:
            raise FileNotFoundError(
                f"{root}: no images ({', '.join(suffixes)}) in class subfolders; expected root/<class>/<image>"
            )

    def shard_length(self, shard: int) -> int:
        return len(self.samples)

    def read(self, shard: int, index: int) -> tuple[torch.Tensor | bytes, int]:
        path, label = self.samples[index]
        with _reading(path, "cannot read image file"), open(path, "rb") as file:
            data = file.read()
        return (decode_image(data, path) if self.decode else data), label


class NumpySource(Source):
    """Rows of ``.npy`` files (memory-mapped) or ``.npz`` archives (loaded whole), one shard per file.

    A ``.npy`` row is a tensor; an ``.npz`` row is ``{name: tensor}`` over arrays sharing their
    first dimension, or only the row of array ``key`` when it is given.
    """

    def __init__(self, files: Files, key: str | None = None, errors: str = "raise") -> None:
        super().__init__(expand_files(files, "NumPy files", errors), errors)
        self.key = key

    def shard_length(self, shard: int) -> int:
        arrays = self._load(shard)
        return len(next(iter(arrays.values())) if isinstance(arrays, dict) else arrays)

    def read(self, shard: int, index: int) -> torch.Tensor | dict[str, torch.Tensor]:
        arrays = self._load(shard)
        if not isinstance(arrays, dict):
            return _tensor(arrays[index])
        if self.key is not None:
            return _tensor(arrays[self.key][index])
        return {name: _tensor(array[index]) for name, array in arrays.items()}

    def _load(self, shard: int) -> np.ndarray | dict[str, np.ndarray]:
        path = self.shards[shard]
        if path.endswith(".npz"):
            return _cache(self, 8).get(shard, lambda: _load_npz(path, self.key))
        return _cache(self, 8).get(shard, lambda: _load_npy(path))


class _Cache:
    """A thread-safe LRU of one process; a missing value is loaded once while others wanting it wait."""

    def __init__(self, capacity: int) -> None:
        self.pid = os.getpid()
        self.capacity = capacity
        self.lock = threading.Lock()
        self.values: OrderedDict[Any, Any] = OrderedDict()
        self.loading: dict[Any, threading.Lock] = {}

    def get(self, key: Any, load: Callable[[], Any]) -> Any:
        with self.lock:
            if key in self.values:
                self.values.move_to_end(key)
                return self.values[key]
            gate = self.loading.setdefault(key, threading.Lock())
        with gate:
            with self.lock:
                if key in self.values:  # loaded by the thread we waited for
                    return self.values[key]
            try:
                value = load()
                with self.lock:
                    self.values[key] = value
                    while len(self.values) > self.capacity:
                        self.values.popitem(last=False)  # a reader still holding it keeps it alive
            finally:
                with self.lock:
                    self.loading.pop(key, None)
            return value


def _cache(source: Source, capacity: int) -> _Cache:
    """The source's cache for this process, made anew after a fork or unpickling."""
    cache = getattr(source, "_open_cache", None)
    if cache is None or cache.pid != os.getpid():
        cache = source._open_cache = _Cache(capacity)  # two threads racing here only waste a cache
    return cache


@contextlib.contextmanager
def _reading(path: str, what: str, *errors: type[BaseException]) -> Iterator[None]:
    """Turn a failure to read ``path`` into a DataFileError naming it."""
    try:
        yield
    except (OSError, ValueError, EOFError, *errors) as error:
        raise DataFileError(path, f"{what} ({error})") from error


def _column_values(column: Any) -> np.ndarray | list:
    """A pyarrow column as a numpy array when numeric without nulls, else as a Python list."""
    import pyarrow as pa

    kind = column.type
    numeric = pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
    return column.to_numpy() if numeric and not column.null_count else column.to_pylist()


def _tar_index(path: str) -> list[tuple[str, dict[str, tuple[int, int]]]]:
    """For each sample of a tar: its key and {ext: (data offset, size)}, from the headers alone."""
    samples: list[tuple[str, dict[str, tuple[int, int]]]] = []
    with _reading(path, "not a readable uncompressed tar", tarfile.TarError), tarfile.open(path, "r:") as tar:
        for member in tar:
            directory, base = posixpath.split(member.name)
            if not member.isfile() or "." not in base:
                continue
            stem, ext = base.split(".", 1)
            key = posixpath.join(directory, stem)
            if not samples or samples[-1][0] != key:
                samples.append((key, {}))
            if ext in samples[-1][1]:
                raise DataFileError(path, f"sample {key!r} has two .{ext} members")
            samples[-1][1][ext] = (member.offset_data, member.size)
        # tarfile takes a cut-off or garbled header for the end; a whole tar ends with a zero block
        tar.fileobj.seek(tar.offset)
        if tar.fileobj.read(tarfile.BLOCKSIZE) != bytes(tarfile.BLOCKSIZE):
            raise DataFileError(path, f"truncated or corrupt after byte {tar.offset} (no end-of-archive block)")
    return samples


# NumPy parses an .npy header with ast.literal_eval, which CPython before 3.11.8 cannot run in
# two threads at once ("AST constructor recursion depth mismatch"): thread workers take turns.
_NPY_HEADER = threading.Lock()


def _decode_member(ext: str, data: bytes) -> Any:
    kind = ext.rsplit(".", 1)[-1].lower()  # "seg.png" decodes as png
    if "." + kind in IMAGE_EXTENSIONS:
        return _rgb_chw(data)
    if kind in ("cls", "index"):
        return int(data)
    if kind == "txt":
        return data.decode("utf-8")
    if kind == "json":
        return json.loads(data)
    if kind == "npy":
        with _NPY_HEADER:
            return _tensor(np.load(io.BytesIO(data)))
    return data


def _rgb_chw(data: bytes) -> torch.Tensor:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        pixels = np.array(image.convert("RGB"))
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


def _tensor(array: Any) -> torch.Tensor:
    """A writable torch copy of an array or array row, in native byte order."""
    array = np.asarray(array)
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True))


def _load_npy(path: str) -> np.ndarray:
    with _reading(path, "not a readable .npy file"), _NPY_HEADER:
        array = np.lib.format.open_memmap(path, mode="r")
    if array.ndim == 0:
        raise DataFileError(path, "does not hold an array with rows")
    return array


def _load_npz(path: str, key: str | None) -> dict[str, np.ndarray]:
    with _reading(path, "not a readable .npz file", zipfile.BadZipFile), _NPY_HEADER, np.load(path) as archive:
        if key is not None and key not in archive.files:
            raise DataFileError(path, f"has no array {key!r} (it holds: {', '.join(archive.files)})")
        arrays = {name: archive[name] for name in ([key] if key is not None else archive.files)}
    rows = {name: array.shape[0] if array.ndim else None for name, array in arrays.items()}
    if not arrays or None in rows.values() or len(set(rows.values())) != 1:
        raise DataFileError(path, f"needs arrays sharing their first dimension, found {rows or 'none'}")
    return arrays
