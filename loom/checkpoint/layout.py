"""Checkpoint directories: written under a temporary name, committed by rename, the last K kept.

    root/
      step-00000120/            a committed checkpoint
        .metadata  __0_0.distcp ...   DCP's files: every tensor, each rank writing its share
        loom.json               everything else (step, epoch, strategy, world size, optimizer
                                hyper-parameters, input position, user values), from rank 0
        rank-00000.json ...     each replica's RNG states
        COMMITTED               written last, before the rename: every file's size, and the
                                XXH3-128 digest of each 16 MiB of it (the algorithm recorded)
      .tmp-step-00000140/       a save in progress, or one cut short (kill -9): never read
      .replaced-step-00000120/  step 120 saved again: the old copy, until the new one is in place

A rename within one filesystem is atomic, so a reader sees a whole checkpoint or none; one
interrupted at any point leaves the previous checkpoints as they were. A step saved again
replaces its checkpoint by two renames, and one of the two copies is found at every moment.
In a job of several nodes the root must be on storage that every node sees.

``COMMITTED`` is what a reader trusts: a file it does not list is never read, and a listed
file whose size or digest differs is damage, named by the file. Checkpoints written before
digests were recorded list sizes only; they are still read, their sizes checked. Those written
with SHA-256 digests (under a "sha256" key, before the algorithm was recorded) are checked with it.

The digests find corruption (flipped bits, torn or cut-short writes), not forgery: whoever can
rewrite a checkpoint's files can rewrite ``COMMITTED`` too. So a fast non-cryptographic hash,
XXH3-128 (about 10x SHA-256's speed), serves; what keeps code from running is ``safe_reader``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import xxhash

from loom.devices import available_cores
from loom.errors import CheckpointError

MARKER = "COMMITTED"
DIGEST = "xxh3_128"  # the algorithm new checkpoints record in MARKER
HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}  # each releases the GIL while it hashes
_OLD_DIGEST = "sha256"  # MARKER's key for its digests before the algorithm was recorded
DIGEST_ENV = "LOOM_CHECKPOINT_DIGEST"  # sha256 where a policy asks for a cryptographic hash (about 1.2x a restore on 2 cores)


def chosen_digest() -> str:
    """The algorithm a new checkpoint records: XXH3-128 unless ``LOOM_CHECKPOINT_DIGEST`` names another."""
    name = (os.environ.get(DIGEST_ENV) or DIGEST).lower()
    if name not in HASHES:
        raise CheckpointError(f"{DIGEST_ENV}={name!r} is not a digest loom knows: use one of {', '.join(HASHES)}")
    return name
BLOCK = 2**24  # bytes a digest covers: a reader checks each block before it reads it, the next ones meanwhile
HASH_THREADS = 8  # at most
_STEP = re.compile(r"^step-(\d+)$")
_REPLACED = re.compile(r"^\.replaced-step-(\d+)$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def temp_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f".tmp-step-{step:08d}"


def step_of(path: Path) -> int:
    """The step of a checkpoint directory (``step-N``, or its replaced copy)."""
    return int(path.name.rsplit("-", 1)[1])


def committed(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first.

    A replaced copy counts only while its step has no ``step-N``: a save of that step was cut
    short between its two renames.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for pattern in (_REPLACED, _STEP):  # step-N wins over its replaced copy
        for p in root.iterdir():
            if (m := pattern.match(p.name)) and (p / MARKER).is_file():
                found[int(m.group(1))] = p
    return [found[step] for step in sorted(found)]


def next_step(root: str | os.PathLike) -> int:
    """The step after the newest complete checkpoint under ``root``; 0 when there is none."""
    done = committed(root)
    return step_of(done[-1]) + 1 if done else 0


def resolve(path: str | os.PathLike) -> Path | None:
    """A checkpoint directory itself, or the latest complete one under a root; None if there is none."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    found = committed(path)
    return found[-1] if found else None


def commit(temp: Path, final: Path) -> None:
    """Record every file's size and digest, then make the checkpoint visible in one rename.

    A step saved again keeps its old checkpoint, renamed aside, until the new one has its name.
    """
    files = sorted(p for p in temp.iterdir() if p.is_file())
    sizes = {p.name: p.stat().st_size for p in files}
    marker = temp / MARKER
    algorithm = chosen_digest()
    listing = {"files": sizes, "digest": algorithm, "blocks": dict(zip(sizes, digests(temp, sizes, algorithm=algorithm)))}
    marker.write_text(json.dumps(listing, indent=1))
    _fsync(marker)
    _fsync(temp)
    if not final.exists():
        os.rename(temp, final)
        _fsync(final.parent)
        return
    aside = final.with_name(f".replaced-{final.name}")
    if aside.exists():  # left by a replacement cut short after its second rename
        shutil.rmtree(aside)
    os.rename(final, aside)
    os.rename(temp, final)
    _fsync(final.parent)
    shutil.rmtree(aside)


def digests(path: Path, sizes: dict[str, int], unreadable: str | None = None, algorithm: str = DIGEST) -> list[list[str]]:
    """The block digests of each file ``sizes`` lists in ``path``, hashed on several threads.

    ``unreadable`` stands for a block that cannot be read (None: raise).
    """
    blocks = [(path / name, i) for name, size in sizes.items() for i in range(blocks_of(size))]
    with ThreadPoolExecutor(hash_threads() + 1, thread_name_prefix="loom-digest") as pool:
        found = iter(pool.map(lambda block: digest_block(*block, unreadable, algorithm), blocks))
    return [[next(found) for _ in range(blocks_of(size))] for size in sizes.values()]


def blocks_of(size: int) -> int:
    return max(1, -(-size // BLOCK))


def digest_block(file: Path, index: int, unreadable: str | None = None, algorithm: str = DIGEST) -> str:
    """The hex digest of the ``index``-th BLOCK bytes of ``file``."""
    digest, buffer = HASHES[algorithm](), memoryview(bytearray(2**20))
    try:
        with open(file, "rb") as f:
            f.seek(index * BLOCK)
            left = BLOCK
            while left and (n := f.readinto(buffer[: min(left, len(buffer))])):
                digest.update(buffer[:n])
                left -= n
    except OSError:
        if unreadable is None:
            raise
        return unreadable
    return digest.hexdigest()


def hash_threads(spare: int = 0) -> int:
    """Threads to hash with: one per core, less ``spare`` cores left to other work; at least one."""
    return max(1, min(HASH_THREADS, available_cores() - spare))


def prune(root: str | os.PathLike, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints; drop the rest and any temporary directory left behind."""
    done = committed(root)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    newest = step_of(done[-1]) if done else -1
    for temp in Path(root).glob(".tmp-step-*"):  # older than the newest commit: abandoned
        if step_of(temp) <= newest:
            shutil.rmtree(temp, ignore_errors=True)
    for aside in Path(root).glob(".replaced-step-*"):  # superseded by its step-N
        if aside not in done:
            shutil.rmtree(aside, ignore_errors=True)


def clear_temp(temp: Path) -> None:
    if temp.exists():
        shutil.rmtree(temp)
    temp.mkdir(parents=True)


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint's ``COMMITTED`` lists: each file's size, and its block digests (None: saved
    before digests) with the algorithm that made them."""

    path: Path
    sizes: dict[str, int]
    digests: dict[str, list[str]] | None
    algorithm: str = DIGEST

    def check(self, names: Iterable[str]) -> None:
        """Raise, naming the file, when one of ``names`` is not listed or differs from its recorded digests."""
        names = list(names)
        for name in names:
            if name not in self.sizes:
                raise CheckpointError(f"{self.path / name}: not listed in {MARKER}: this is not a complete checkpoint")
        if self.digests is None:
            return
        wanted = {n: self.sizes[n] for n in names}
        for name, found in zip(names, digests(self.path, wanted, unreadable="", algorithm=self.algorithm)):
            if found != self.digests[name]:
                raise CheckpointError(damage(self.path / name, self.algorithm))


def damage(file: Path, algorithm: str) -> str:
    return f"{file}: damaged: its content differs from the {algorithm} recorded when it was saved"


def manifest(path: Path) -> Manifest:
    """The checkpoint's ``COMMITTED``; an error naming it when it is unreadable or lists a path outside the checkpoint."""
    marker = path / MARKER
    try:
        listing = json.loads(marker.read_text())
        sizes, (algorithm, recorded) = listing["files"], _recorded(listing)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{marker}: unreadable ({error}); the checkpoint is damaged") from error
    if not isinstance(sizes, dict) or not all(_plain_name(n) and type(s) is int and s >= 0 for n, s in sizes.items()):
        raise CheckpointError(f"{marker}: damaged: its file list is not file names with sizes")
    if (algorithm is not None or "digest" in listing) and not (isinstance(algorithm, str) and algorithm in HASHES):
        raise CheckpointError(
            f"{marker}: its digests use {algorithm!r}, which this loom does not know ({', '.join(HASHES)}); "
            "verify or restore it with the loom that saved it"
        )
    if algorithm is not None and not _digests_of(recorded, sizes):
        raise CheckpointError(f"{marker}: damaged: its {algorithm} digests do not match its file list")
    return Manifest(path, sizes, recorded, algorithm or DIGEST)


def _recorded(listing: dict[str, Any]) -> tuple[Any, Any]:
    """The digests' algorithm and the digests; SHA-256 under its own key as loom first wrote them; (None, None) before digests."""
    if "digest" in listing:
        return listing["digest"], listing.get("blocks")
    if _OLD_DIGEST in listing:
        return _OLD_DIGEST, listing[_OLD_DIGEST]
    return None, None


def _digests_of(digests: Any, sizes: dict[str, int]) -> bool:
    """Whether ``digests`` has, for each file ``sizes`` lists, one digest per block."""
    return (
        isinstance(digests, dict) and set(digests) == set(sizes)
        and all(isinstance(d, list) and len(d) == blocks_of(sizes[n]) and all(isinstance(h, str) for h in d) for n, d in digests.items())
    )  # fmt: skip


def _plain_name(name: Any) -> bool:
    """A file directly in the checkpoint directory: no separator, no '..', not the marker itself."""
    return isinstance(name, str) and name not in ("", ".", "..", MARKER) and not any(c in name for c in "/\\\0")


def verify(path: Path, contents: bool = True) -> Manifest:
    """Every file the marker lists is there with its size (truncation, deletion), and with
    ``contents`` its digest (any other change)."""
    listed = manifest(path)
    for name, size in listed.sizes.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from the checkpoint")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(f"{file}: truncated or altered ({actual} bytes, {size} when saved)")
    if contents:
        listed.check(listed.sizes)
    return listed


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, value: Any, durable: bool = False) -> None:
    """``durable``: on disk before this returns (fsync), like the tensors' files."""
    with open(path, "w") as file:
        file.write(json.dumps(value))
        if durable:
            file.flush()
            os.fsync(file.fileno())


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file; a damaged or missing one is an error naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from error
