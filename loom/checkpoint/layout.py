"""Checkpoint directories: written under a temporary name, committed by rename, the last K kept.

    root/
      step-00000120/            a committed checkpoint
        .metadata  __0_0.distcp ...   DCP's files: every tensor, each rank writing its share
        loom.json               everything else (step, epoch, strategy, world size, optimizer
                                hyper-parameters, input position, user values), from rank 0
        rank-00000.json ...     each replica's RNG states
        COMMITTED               written last, before the rename: every file's size
      .tmp-step-00000140/       a save in progress, or one cut short (kill -9): never read
      .replaced-step-00000120/  step 120 saved again: the old copy, until the new one is in place

A rename within one filesystem is atomic, so a reader sees a whole checkpoint or none; one
interrupted at any point leaves the previous checkpoints as they were. A step saved again
replaces its checkpoint by two renames, and one of the two copies is found at every moment.
In a job of several nodes the root must be on storage that every node sees.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from loom.errors import CheckpointError

MARKER = "COMMITTED"
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
    """Record every file's size, then make the checkpoint visible in one rename.

    A step saved again keeps its old checkpoint, renamed aside, until the new one has its name.
    """
    sizes = {p.name: p.stat().st_size for p in sorted(temp.iterdir()) if p.is_file()}
    marker = temp / MARKER
    marker.write_text(json.dumps({"files": sizes}, indent=1))
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


def verify(path: Path) -> None:
    """Every file the marker lists is there with its size: catches truncation and deletion."""
    try:
        sizes = json.loads((path / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(f"{path / MARKER}: unreadable ({error}); the checkpoint is damaged") from error
    for name, size in sizes.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from the checkpoint")
        actual = file.stat().st_size
        if actual != size:
            raise CheckpointError(f"{file}: truncated or altered ({actual} bytes, {size} when saved)")


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
