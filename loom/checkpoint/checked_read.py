"""Reading a checkpoint's tensor files with each block checked against its digest before DCP gets a byte of it.

The blocks a load reads are hashed on a pool of threads, in the order DCP reads them, from a
memory map of the file: the very pages of the page cache that DCP's reads then copy from, so
nothing is read twice. DCP's view of each file reads block by block, each once it matches its
digest, so DCP copies one block while the next is hashed; a damaged block is never handed on,
and the load stops before any tensor made from it reaches the objects being restored. (As with
any memory map, torch.load(mmap=True)'s included, a file cut short by another process while it
is being read ends this one with SIGBUS.)
"""

from __future__ import annotations

import io
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

from loom.checkpoint.layout import BLOCK, HASHES, Manifest, damage, hash_threads
from loom.errors import CheckpointError


class CheckedBlocks:
    """The blocks of a checkpoint that one load reads, hashed ahead of the reader in the order it reads them."""

    def __init__(self, listed: Manifest, wanted: Iterable[tuple[str, int]]) -> None:
        self._listed = listed
        self._maps: dict[str, memoryview] = {}
        # A core left to DCP's copying: on 2 cores one thread hashes ahead of it (waits: 10-40 ms per 500 MB)
        self._pool = ThreadPoolExecutor(hash_threads(spare=1), thread_name_prefix="loom-digest")
        self._intact: dict[tuple[str, int], Future[bool]] = {}
        for name, index in dict.fromkeys(wanted):
            self._intact[name, index] = self._pool.submit(self._check, self._map(name), name, index)
        self.damaged: CheckpointError | None = None  # the error of the first damaged block met

    def wait(self, name: str, index: int) -> None:
        """Return once a block of ``name`` matches its digest; raise naming the file otherwise."""
        if not self._intact[name, index].result():
            self.damaged = self.damaged or CheckpointError(damage(self._listed.path / name, self._listed.algorithm))
            raise self.damaged

    def view(self, entry: Any, read: io.IOBase) -> CheckedView:
        """``read``, DCP's view of a storage ``entry``'s bytes, reading only checked blocks."""
        return CheckedView(self, entry.relative_path, entry.offset, entry.offset + entry.length, read)

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)
        self._maps.clear()  # each map is unmapped once no view of it is left

    def _map(self, name: str) -> memoryview:
        if name not in self._maps:
            with open(self._listed.path / name, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                self._maps[name] = memoryview(mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ) if size else b"")
        return self._maps[name]

    def _check(self, data: memoryview, name: str, index: int) -> bool:
        """Whether a block matches its digest (the hash releases the GIL while it hashes)."""
        block = data[index * BLOCK : (index + 1) * BLOCK]
        return len(block) == min(BLOCK, self._listed.sizes[name] - index * BLOCK) and (
            HASHES[self._listed.algorithm](block).hexdigest() == self._listed.digests[name][index]
        )


class CheckedView(io.RawIOBase):
    """DCP's view of an entry's bytes in its file, each read waiting until the blocks it covers are checked."""

    def __init__(self, blocks: CheckedBlocks, name: str, start: int, end: int, file: io.IOBase) -> None:
        super().__init__()
        self._blocks, self._name, self._start, self._end, self._file = blocks, name, start, end, file

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._file.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def readinto(self, buffer: Any) -> int:  # type: ignore[override]
        """Block by block, each once it is checked: DCP copies one while the next is hashed."""
        out, done = memoryview(buffer).cast("B"), 0
        while done < len(out):
            at = self._start + self._file.tell()
            end = min(at + len(out) - done, (at // BLOCK + 1) * BLOCK, self._end)
            if end <= at:
                break
            self._blocks.wait(self._name, at // BLOCK)
            n = self._file.readinto(out[done : done + end - at])  # type: ignore[attr-defined]
            if not n:
                break
            done += n
        return done
