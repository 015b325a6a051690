"""Checkpoint directories: written under a temporary name, committed by rename, the last K kept.

    root/
      step-00000120/            a committed checkpoint
        .metadata  __0_0.distcp ...   DCP's files: every tensor, each rank writing its share
        loom.json               everything else (step, epoch, strategy, world size, optimizer
                                hyper-parameters, input position, user values), from rank 0
        rank-00000.json ...     each replica's RNG states
        COMMITTED               written last, before the rename: every file's size
      .tmp-step-00000140/       a save in progress, or one cut short (kill -9): never read

A rename within one filesystem is atomic, so a reader sees a whole checkpoint or none; one
interrupted at any point leaves the previous checkpoints as they were. In a job of several
nodes the root must be on storage that every node sees.
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


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def temp_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f".tmp-step-{step:08d}"


def committed(root: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and (p / MARKER).is_file()]
    return [p for _, p in sorted(found)]


def resolve(path: str | os.PathLike) -> Path | None:
    """A checkpoint directory itself, or the latest complete one under a root; None if there is none."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    found = committed(path)
    return found[-1] if found else None


def commit(temp: Path, final: Path) -> None:
    """Record every file's size, then make the checkpoint visible in one rename."""
    sizes = {p.name: p.stat().st_size for p in sorted(temp.iterdir()) if p.is_file()}
    marker = temp / MARKER
    marker.write_text(json.dumps({"files": sizes}, indent=1))
    _fsync(marker)
    if final.exists():  # the same step saved again
        shutil.rmtree(final)
    os.rename(temp, final)
    _fsync(final.parent)


def prune(root: str | os.PathLike, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints; drop the rest and any temporary directory left behind."""
    done = committed(root)
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    newest = int(_STEP.match(done[-1].name).group(1)) if done else -1  # type: ignore[union-attr]
    for temp in Path(root).glob(".tmp-step-*"):  # older than the newest commit: abandoned
        if int(temp.name.rsplit("-", 1)[1]) <= newest:
            shutil.rmtree(temp, ignore_errors=True)


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


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value))


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file; a damaged or missing one is an error naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from error
