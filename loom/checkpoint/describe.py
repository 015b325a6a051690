"""``loom checkpoint inspect``, ``export`` and ``verify``: what a checkpoint holds, its weights for
serving (written by ``loom.train.export``), and whether it is intact. Each reads only files that ``COMMITTED`` lists, after
checking their sizes and digests, and the index through ``safe_reader``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loom.checkpoint import layout
from loom.checkpoint.safe_reader import index_file, load, read_index
from loom.errors import CheckpointError


def find(path: str | Path) -> tuple[Path, layout.Manifest]:
    """The checkpoint ``path`` names, or the newest complete one under it, with its files' sizes checked."""
    found = layout.resolve(path)
    if found is None:
        raise _none_here(path)
    return found, layout.verify(found, contents=False)


def _none_here(path: str | Path) -> CheckpointError:
    if not Path(path).exists():
        return CheckpointError(f"{path}: no such file or directory")
    return CheckpointError(f"{path}: no complete checkpoint here (a step-* directory with a {layout.MARKER} file)")


def check(path: Path) -> str:
    """How the checkpoint ``path`` was checked; raises, in one line naming the file, when anything in it is damaged or refused."""
    listed = layout.verify(path)
    meta = layout.read_json(path / "loom.json")
    if not isinstance(meta, dict) or not {"format", "step", "kinds", "plain"} <= set(meta):
        raise CheckpointError(f"{path / 'loom.json'}: not loom's description of a checkpoint")
    read_index(path, listed)
    if listed.digests is None:
        return f"sizes intact, contents unchecked: saved before loom recorded digests ({len(listed.sizes)} files)"
    return f"intact ({len(listed.sizes)} files, {sum(listed.sizes.values()):,} bytes, {listed.algorithm} checked)"


def verify(path: str | Path) -> list[tuple[Path, bool, str]]:
    """Each complete checkpoint ``path`` names or holds, oldest first: whether it is intact, and how, or what is wrong."""
    path = Path(path)
    found = [path] if (path / layout.MARKER).is_file() else layout.committed(path)
    if not found:
        raise _none_here(path)
    results: list[tuple[Path, bool, str]] = []
    for checkpoint in found:
        try:
            results.append((checkpoint, True, check(checkpoint)))
        except CheckpointError as error:
            results.append((checkpoint, False, str(error)))
    return results


def describe(path: str | Path) -> dict[str, Any]:
    """Step, strategy, world size, and every saved tensor's shape and dtype."""
    found, listed = find(path)
    listed.check([index_file(found).name, "loom.json"])  # the files it reads
    meta = layout.read_json(found / "loom.json")
    index = read_index(found, listed)
    tensors = {
        key: {"shape": list(entry.size), "dtype": str(entry.properties.dtype).removeprefix("torch.")}
        for key, entry in sorted(index.state_dict_metadata.items())
    }
    values = {k: v for k, v in meta["plain"].items() if meta["kinds"][k] == "value"}
    return {
        "path": str(found),
        "step": meta["step"],
        "strategy": meta["strategy"],
        "world_size": meta["world_size"],
        "saved_at": meta["saved_at"],
        "objects": meta["kinds"],
        "values": values,
        "tensors": tensors,
        "bytes": sum(p.stat().st_size for p in found.iterdir()),
    }


def model_weights(path: str | Path, name: str | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """A saved model's weights, gathered whole from every rank's files, and the step they were saved at."""
    found, listed = find(path)
    listed.check([index_file(found).name, "loom.json"])  # and the tensors' files as they are read
    meta = layout.read_json(found / "loom.json")
    kinds = meta["kinds"]
    modules = [k for k, kind in kinds.items() if kind == "module"]
    if name is None:
        if len(modules) != 1:
            raise CheckpointError(f"{found} holds {len(modules)} models ({', '.join(modules) or 'none'}); choose one with --name")
        name = modules[0]
    if kinds.get(name) != "module":
        raise CheckpointError(f"{found} holds no model named '{name}' (models: {', '.join(modules) or 'none'})")
    prefix = f"{name}."
    index = read_index(found, listed)
    weights = {
        key[len(prefix) :]: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in index.state_dict_metadata.items()
        if key.startswith(prefix)
    }
    load({name: weights}, found, index, listed)
    return weights, meta["step"]
