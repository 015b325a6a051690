"""What a checkpoint holds, split in two: tensors for DCP, everything else for JSON.

Modules and optimizers go through DCP's state-dict API (``get_state_dict``), which keys
optimizer state by parameter name rather than position, so it loads into a model wrapped
differently or sharded over another number of replicas. Any object with ``state_dict`` and
``load_state_dict`` (an input pipeline's loader, an LR scheduler, a GradScaler) is saved the
same way; other values must be tensors or JSON values.

An optimizer saved before its first step has no state, and the checkpoint records none:
saving does not create one (``loom.compat.optimizer_state_dict``), and restoring it leaves
the optimizer without state, as a fresh one is.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from loom.compat import optimizer_state_dict
from loom.errors import CheckpointError, CheckpointMismatchError

Tree = dict[str, Any]


def collect(state: dict[str, Any], saved: Tree | None = None) -> tuple[Tree, Tree, dict[str, str]]:
    """``(tensors, plain, kinds)`` of the named objects a user passed to save or restore.

    ``saved``: when restoring, the plain values of the checkpoint they are restored from.
    """
    tensors: Tree = {}
    plain: Tree = {}
    kinds: dict[str, str] = {}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            kinds[name], tree = "module", get_model_state_dict(value)
        elif isinstance(value, torch.optim.Optimizer):
            kinds[name], tree = "optimizer", _optimizer_tree(_owner(value, state), value, None if saved is None else saved.get(name))
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            kinds[name], tree = "stateful", value.state_dict()
        elif isinstance(value, torch.Tensor):
            kinds[name], tensors[name] = "tensor", value
            continue
        else:
            kinds[name], plain[name] = "value", _json_value(value, name)
            continue
        tensors[name], plain[name] = split(tree, name)
    return tensors, plain, kinds


def _optimizer_tree(model: nn.Module, optimizer: torch.optim.Optimizer, saved: Tree | None) -> Tree:
    """The optimizer's state to save (``saved`` None), or to load the checkpoint's ``saved`` into.

    Loading needs tensors to load into, which DCP creates in an optimizer without state; a
    checkpoint saved before the first step has none to load.
    """
    if saved is None:
        return optimizer_state_dict(model, optimizer)
    if saved.get("state"):
        return get_optimizer_state_dict(model, optimizer)
    return {**optimizer_state_dict(model, optimizer), "state": {}}


def check_names(state: dict[str, Any], kinds: dict[str, str], path: Any) -> None:
    """Refuse names the checkpoint lacks before anything is loaded.

    A mismatch, not damage: the checkpoints before it would lack the name too, so ``fallback``
    must not pass over them, and no object may be left loaded from one checkpoint and not another.
    """
    missing = [name for name in state if name not in kinds]
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint does not match: {path} holds no {', '.join(repr(n) for n in missing)} "
            f"(it holds: {', '.join(sorted(kinds))}); pass the names it was saved with"
        )


def apply(state: dict[str, Any], kinds: dict[str, str], loaded: Tree, strict: bool = True) -> None:
    """Load ``loaded`` into the user's objects in place (plain values come back from ``restore``).

    Every name is one ``kinds`` has (``check_names``). ``strict=False``: a model's keys that
    ``loaded`` lacks keep their values.
    """
    for name, value in state.items():
        kind = kinds[name]
        if kind == "module":
            set_model_state_dict(value, loaded[name], options=StateDictOptions(strict=strict))
        elif kind == "optimizer":
            set_optimizer_state_dict(_owner(value, state), value, loaded[name])
        elif kind == "stateful":
            value.load_state_dict(loaded[name])
        elif kind == "tensor":
            value.copy_(loaded[name])


def split(tree: Any, where: str) -> tuple[Any, Any]:
    """The tensors of a nested dict, and the rest with tensors left out."""
    if isinstance(tree, torch.Tensor):
        return tree, None
    if isinstance(tree, dict):
        tensors, plain = {}, {}
        for key, value in tree.items():
            if not isinstance(key, str):
                raise CheckpointError(f"cannot save {where}: key {key!r} is not a string")
            t, p = split(value, f"{where}.{key}")
            if t is not None and t != {}:
                tensors[key] = t
            if p is not None or not isinstance(value, (torch.Tensor, dict)):
                plain[key] = p
        return tensors, plain
    return None, _json_value(tree, where)


def merge(tensors: Any, plain: Any) -> Any:
    """``split`` undone: tensors put back into the plain tree."""
    if isinstance(tensors, dict):
        merged = dict(plain or {})
        for key, value in tensors.items():
            merged[key] = merge(value, merged.get(key))
        return merged
    return plain if tensors is None else tensors


def flatten(tree: Tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Dotted keys, as DCP writes them in its index."""
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


def without(tree: Tree, keys: set[str], prefix: str = "") -> Tree:
    """``tree`` less the tensors at the dotted ``keys`` (as ``flatten`` names them)."""
    kept: Tree = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            kept[key] = without(value, keys, f"{path}.")
        elif path not in keys:
            kept[key] = value
    return kept


def rng_state() -> dict[str, Any]:
    """This process's random generators (torch, CUDA, NumPy, Python), as JSON."""
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": _numpy_state(),
        "python": list(random.getstate()[1]) + [random.getstate()[0]],
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    *internal, version = state["python"]
    random.setstate((version, tuple(internal), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def _owner(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> nn.Module:
    """The module among the saved objects whose parameters the optimizer updates."""
    first = next(p for group in optimizer.param_groups for p in group["params"])
    for value in state.values():
        if isinstance(value, nn.Module) and any(p is first for p in value.parameters()):
            return value
    raise CheckpointMismatchError(  # a usage error, not damage: no older checkpoint would do better
        "an optimizer is saved and restored with its model: pass both, e.g. save(dir, model=model, optimizer=opt)"
    )


def _json_value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_value(v, f"{where}.{k}") for k, v in value.items()}
    raise CheckpointError(
        f"cannot save {where}: a {type(value).__name__} is neither a tensor nor a JSON value "
        "(numbers, strings, lists, dicts); loom never pickles"
    )


def _numpy_state() -> list[Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
