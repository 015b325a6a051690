"""A parameter server's write-ahead log: every change to its state since its last snapshot.

A server appends a record for each change (a push applied, a round's share, a ``create``, a
``write``...) while it holds the locks of what changed, and makes the records durable
(``fsync``) before it acknowledges the request. A server restarted after ``kill -9`` loads its
last snapshot and replays the log, so it comes back with every update a worker saw
acknowledged. Each snapshot starts a new generation of the log (``FILE.log.<n>``) and removes
the generations it holds.

    file:   b"LOOMWAL1", then records
    record: [8-byte length][16-byte BLAKE2b of the message][message: ``wire.encode``, JSON and raw tensor bytes]

Nothing is unpickled. A record cut short at the end of a file was being written when the
server died and was never acknowledged: replay skips it. A record whose digest does not match,
one cut short before a later generation, or a missing generation, is damage: replay stops
there and says so.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from loom.errors import CheckpointError
from loom.strategies.parameter_server.wire import WireError, decode, encode

MAGIC = b"LOOMWAL1"
_HEAD = struct.Struct("<Q16s")

Record = tuple[dict[str, Any], dict[str, torch.Tensor]]


def generation_path(snapshot: str | os.PathLike, generation: int) -> Path:
    return Path(f"{snapshot}.log.{generation}")


def generations(snapshot: str | os.PathLike) -> list[int]:
    """The log generations present beside ``snapshot``, in order."""
    path = Path(snapshot)
    prefix = f"{path.name}.log."
    found = [p.name[len(prefix) :] for p in path.parent.glob(f"{path.name}.log.*")] if path.parent.exists() else []
    return sorted(int(g) for g in found if g.isdigit())


class WriteAheadLog:
    """Appends records to ``FILE.log.<generation>``; ``sync`` makes every record so far durable.

    ``append`` is called under the server's locks (it orders the records as the changes were
    made); ``sync`` outside them, so that requests arriving together share one ``fsync``.
    """

    def __init__(self, snapshot: str | os.PathLike, generation: int, durable: bool = True) -> None:
        self.snapshot = Path(snapshot)
        self.durable = durable  # False: written (a kill -9 keeps it) but not fsync'd (a power cut may not)
        self.generation = generation
        self.appended = 0  # records appended, over every generation
        self.synced = 0
        self._sync_lock = threading.Lock()
        self._fd = self._open(generation)

    def _open(self, generation: int) -> int:
        fd = os.open(generation_path(self.snapshot, generation), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        _write(fd, MAGIC)
        return fd

    def append(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
        message = encode(fields, tensors)
        _write(self._fd, _HEAD.pack(len(message), _digest(message)) + message)
        self.appended += 1

    def sync(self) -> None:
        """Return once every record appended before the call is on disk."""
        target = self.appended
        if not self.durable or self.synced >= target:
            return
        with self._sync_lock:
            if self.synced >= target:  # another request's fsync covered this one
                return
            upto = self.appended
            os.fsync(self._fd)
            self.synced = max(self.synced, upto)

    def rotate(self) -> int:
        """Start the next generation (the caller holds every lock of the server's state); its number."""
        with self._sync_lock:
            if self.durable:
                os.fsync(self._fd)
            os.close(self._fd)
            self.generation += 1
            self._fd = self._open(self.generation)
            self.synced = self.appended
        return self.generation

    def prune(self, before: int) -> None:
        """Remove the generations a snapshot now holds."""
        for generation in generations(self.snapshot):
            if generation < before:
                generation_path(self.snapshot, generation).unlink(missing_ok=True)

    def close(self) -> None:
        with self._sync_lock:
            os.close(self._fd)


@dataclass
class Replay:
    """What a restarted server read from its log: the records to apply, and any damage found."""

    records: list[Record] = field(default_factory=list)
    damage: str | None = None  # why replay stopped before the end of the log


def read(snapshot: str | os.PathLike, first: int) -> Replay:
    """The records of generations ``first`` on, in order, up to the first damage."""
    replay = Replay()
    present = [g for g in generations(snapshot) if g >= first]
    for expected, generation in enumerate(present, start=first):
        if generation != expected:
            replay.damage = f"generation {expected} of the log is missing (the next is {generation})"
            return replay
        replay.records.extend(_records(generation_path(snapshot, generation), replay, last=generation == present[-1]))
        if replay.damage:
            return replay
    return replay


def _records(path: Path, replay: Replay, last: bool) -> Iterator[Record]:
    """The records of one generation. Only the ``last`` may end in a record cut short: the
    others were fsync'd and closed whole before the next began."""
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        if len(data) < len(MAGIC) and MAGIC.startswith(data):
            return  # created, then killed before its first bytes were written
        raise CheckpointError(f"{path} is not a loom parameter-server log (it does not start with {MAGIC!r}); it is not read")
    offset, index = len(MAGIC), 0
    while offset < len(data):
        length, digest = _HEAD.unpack_from(data, offset) if offset + _HEAD.size <= len(data) else (len(data), b"")
        start = offset + _HEAD.size
        if start + length > len(data):  # cut short: being written when the server died, never acknowledged
            if not last:
                replay.damage = f"record {index} of {path} is cut short, and later generations follow"
            return
        message = data[start : start + length]
        if _digest(message) != digest:
            replay.damage = f"record {index} of {path} is damaged (its digest does not match)"
            return
        try:
            yield decode(message)
        except WireError as error:
            replay.damage = f"record {index} of {path} does not decode ({error})"
            return
        offset, index = start + length, index + 1


def _digest(message: bytes) -> bytes:
    return hashlib.blake2b(message, digest_size=16).digest()


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
