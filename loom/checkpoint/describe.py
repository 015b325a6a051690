"""``loom checkpoint inspect`` and ``export``: what a checkpoint holds, and its weights for serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from loom.checkpoint import layout
from loom.checkpoint.safe_reader import SafeFileSystemReader, quiet, read_index
from loom.errors import CheckpointError


def find(path: str | Path) -> Path:
    """The checkpoint ``path`` names, or the newest complete one under it."""
    found = layout.resolve(path)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint here (a step-* directory with a {layout.MARKER} file)")
    layout.verify(found)
    return found


def describe(path: str | Path) -> dict[str, Any]:
    """Step, strategy, world size, and every saved tensor's shape and dtype."""
    found = find(path)
    meta = layout.read_json(found / "loom.json")
    index = read_index(found / ".metadata")
    tensors = {
        key: {"shape": list(entry.size), "dtype": str(entry.properties.dtype).removeprefix("torch.")}
        for key, entry in sorted(index.state_dict_metadata.items())
        if hasattr(entry, "size")
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


def export(path: str | Path, out: str | Path, name: str | None = None) -> Path:
    """The model's weights, gathered whole from every rank's files, as one safetensors file."""
    from safetensors.torch import save_file

    found = find(path)
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
    index = read_index(found / ".metadata")
    weights = {
        key[len(prefix) :]: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in index.state_dict_metadata.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }
    with quiet():
        dcp.load({name: weights}, storage_reader=SafeFileSystemReader(found), no_dist=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out), metadata={"step": str(meta["step"])})
    return Path(out)
