"""What a model returns, walked without changing its type; and the loss a model computed itself.

A model's output may be a tensor or a container of them: a list, a tuple (a namedtuple), a
dict (a subclass with attributes, such as Hugging Face's ``ModelOutput``) or a dataclass.
Casting it to fp32, detaching it or joining micro-batches' outputs must hand back the same
class, so ``out.logits`` still works after the strategy touched it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch


def map_outputs(fn: Callable[..., Any], out: Any, *others: Any) -> Any:
    """``fn`` applied to every leaf of ``out`` (and the same leaf of each of ``others``), in a copy of the same containers."""
    parts = _children(out)
    if parts is None:
        return fn(out, *others)
    mapped = {key: map_outputs(fn, value, *(_children(o)[key] for o in others)) for key, value in parts.items()}  # type: ignore[index]
    return _rebuild(out, mapped)


def _children(out: Any) -> dict[Any, Any] | None:
    """A container's items by key (indices for sequences), or None for a leaf."""
    if isinstance(out, (list, tuple)):
        return dict(enumerate(out))
    if isinstance(out, Mapping):
        return dict(out.items())
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    return None


def _rebuild(out: Any, items: dict[Any, Any]) -> Any:
    """A copy of ``out``, of its class, holding ``items``; attributes that mirror an item follow it."""
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a namedtuple takes its fields one by one
        return type(out)(*items.values())
    if isinstance(out, (list, tuple)):
        return type(out)(items.values())
    new = copy.copy(out)
    if isinstance(out, Mapping):
        for key, value in items.items():
            new[key] = value  # through the class's own __setitem__ (ModelOutput keeps its attribute in step)
        for name, old in vars(out).items() if hasattr(out, "__dict__") else ():
            mirrored = next((items[k] for k, v in out.items() if v is old), None)
            if mirrored is not None:
                object.__setattr__(new, name, mirrored)
        return new
    for name, value in items.items():  # a dataclass, frozen or not
        object.__setattr__(new, name, value)
    return new


def model_loss(out: Any) -> torch.Tensor:
    """The loss in what a model that computes its own loss returned.

    A scalar tensor is the loss; a dict (or object) holds it as ``"loss"`` (``.loss``), as
    Hugging Face's outputs do; a tuple or list holds exactly one scalar tensor, wherever it is:
    nanoGPT's ``(logits, loss)`` and Hugging Face's ``(loss, logits, ...)`` both qualify.
    """
    if isinstance(out, torch.Tensor):
        loss = out
    elif isinstance(out, Mapping) and "loss" in out:
        loss = out["loss"]
    elif not isinstance(out, (list, tuple)) and isinstance(getattr(out, "loss", None), torch.Tensor):
        loss = out.loss
    elif isinstance(out, (list, tuple)):
        scalars = [o for o in out if isinstance(o, torch.Tensor) and o.dim() == 0]
        if len(scalars) != 1:
            raise ValueError(
                f"with loss_fn=None the model's {type(out).__name__} output must hold exactly one scalar tensor, "
                f"its loss; it holds {len(scalars)}: return (outputs, loss), or a dict with a 'loss' entry"
            )
        loss = scalars[0]
    else:
        raise TypeError(
            f"with loss_fn=None the model computes its loss, but it returned {type(out).__name__}: return the loss, "
            "(outputs, loss), or a dict/object with a 'loss' entry"
        )
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"with loss_fn=None the model's loss must be a scalar tensor (the batch mean), got {shape}")
    return loss


def model_logits(out: Any) -> torch.Tensor:
    """The per-sample scores in what a model that computes its own loss returned, for a metric.

    A tensor is the scores; a dict (or object) holds them as ``"logits"`` (``.logits``); a tuple
    or list holds exactly one tensor besides its scalar loss: ``(logits, loss)`` or ``(loss, logits)``.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    if not isinstance(out, (list, tuple, Mapping)) and isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    scores = [o for o in out if isinstance(o, torch.Tensor) and o.dim() > 0] if isinstance(out, (list, tuple)) else []
    if len(scores) != 1:
        raise ValueError(
            f"a built-in metric scores the model's logits, but its {type(out).__name__} output does not say which they are: "
            "return (logits, loss) or a dict/object with a 'logits' entry, or pass a metric function that takes the output"
        )
    return scores[0]


def call_with_targets(model: Callable[..., Any], inputs: Any, targets: Any) -> Any:
    """Call a model that computes its own loss: ``model(inputs, targets)``, ``model(inputs)``
    without targets, ``model(**inputs)`` for a dict of inputs (labels included)."""
    if isinstance(inputs, Mapping):
        if targets is not None:
            raise ValueError(
                "with loss_fn=None a dict of inputs is passed as model(**inputs): put the targets in it "
                "(e.g. as 'labels') and give None as the targets"
            )
        return model(**inputs)
    return model(inputs) if targets is None else model(inputs, targets)
