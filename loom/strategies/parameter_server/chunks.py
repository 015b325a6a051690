"""A variable and its optimizer slots streamed in chunks of rows: how a checkpoint reads a large
table off a server, and how a restore writes it back, within gRPC's message limit."""

from __future__ import annotations

from typing import Any

import torch

from loom.strategies.parameter_server.wire import WireError


def read(value: torch.Tensor, slots: dict[str, Any], start: int, budget: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Rows ``start:`` of a variable and of its optimizer slots, as many as fit in ``budget`` bytes.

    Slots shaped like the variable come in the same rows; other slot tensors and numbers
    (steps) come with the first chunk. ``next`` is the row to ask for next (the row count: done).
    """
    rowwise = {k: _rows(v) for k, v in slots.items() if _rowwise(v, value)}
    row_bytes = sum(t[:1].numel() * t.element_size() for t in [_rows(value), *rowwise.values()])
    end = min(len(_rows(value)), start + max(1, budget // max(row_bytes, 1)))
    tensors = {"value": _rows(value)[start:end].clone(), **{f"slot/{k}": v[start:end].clone() for k, v in rowwise.items()}}
    first = {}
    if start == 0:
        tensors.update({f"whole/{k}": v.clone() for k, v in slots.items() if isinstance(v, torch.Tensor) and k not in rowwise})
        first = {k: v for k, v in slots.items() if isinstance(v, (int, float))}
    return {"next": end, "rows": len(_rows(value)), "scalars": first}, tensors


def write(value: torch.Tensor, state: dict[str, dict[str, Any]], fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """The inverse of ``read``, into ``value`` and ``state[name]`` (the optimizer's). With ``slots``
    (numbers, on the first chunk) the variable's optimizer state is replaced by what the chunks
    carry; without, it is kept."""
    name, start, rows = fields["name"], fields["start"], tensors["value"]
    if rows.shape[1:] != _rows(value).shape[1:] or start + len(rows) > len(_rows(value)):
        raise WireError(f"cannot write {list(rows.shape)} at row {start} of '{name}' {list(value.shape)}")
    _rows(value)[start : start + len(rows)] = rows.to(value.dtype)
    if "slots" in fields:
        state[name] = {**fields["slots"]}
    slots = state.get(name)
    for key, tensor in tensors.items():
        kind, _, slot = key.partition("/")
        if kind == "whole" and slots is not None:
            slots[slot] = tensor.clone()
        elif kind == "slot" and slots is not None:
            if not _rowwise(slots.get(slot), value):
                slots[slot] = torch.zeros_like(value)
            _rows(slots[slot])[start : start + len(tensor)] = tensor


def _rowwise(slot: Any, value: torch.Tensor) -> bool:
    """An optimizer slot shaped like its variable (momentum, Adam's moments), streamed by rows."""
    return isinstance(slot, torch.Tensor) and slot.shape == value.shape


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """A view with rows to slice: a 0-d tensor as one row."""
    return tensor.reshape(1) if tensor.dim() == 0 else tensor
