"""Batches and outputs as nested lists, tuples and dicts of tensors, walked without torch's private pytree."""

from __future__ import annotations

from typing import Any, Callable

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor replaced by ``fn(tensor)``; other leaves kept."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_tensors(fn, t) for t in tree)
    if isinstance(tree, dict):
        return {k: map_tensors(fn, v) for k, v in tree.items()}
    return tree


def leaves(tree: Any) -> list[Any]:
    """Every leaf of ``tree``, tensors or not, in order."""
    if isinstance(tree, (list, tuple)):
        return [leaf for t in tree for leaf in leaves(t)]
    if isinstance(tree, dict):
        return [leaf for v in tree.values() for leaf in leaves(v)]
    return [tree]
