"""The servers' variables and optimizer slots as a plain model and a torch optimizer, and back.

A parameter-server checkpoint is an ordinary loom checkpoint of the model as the user built
it (tables included) and of a torch optimizer of the user's class holding the servers' slots,
so it restores under any strategy, and any strategy's checkpoint restores here. Variables
move in pieces of at most ``transport.chunk_bytes()``: no message exceeds the limit, however
large a server's share of a table.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.strategies.parameter_server import transport
from loom.strategies.parameter_server.variables import ShardedVariables

TORCH_KEYS = {"momentum": "momentum_buffer"}  # a server slot -> the key torch's optimizer keeps it under
SERVER_KEYS = {v: k for k, v in TORCH_KEYS.items()}
Slots = dict[str, Any]


def _holders(variables: ShardedVariables, name: str) -> list[int]:
    """The servers holding ``name``, in row order."""
    placement = variables.placement
    if name in placement.dense:
        return [placement.dense[name]]
    bounds = placement.row_bounds[name]
    return [s for s in range(placement.num_servers) if bounds[s + 1] > bounds[s]]


def pull_variable(variables: ShardedVariables, name: str) -> tuple[torch.Tensor, Slots]:
    """A variable with its slots (server names), read piece by piece from every server holding it."""
    values: list[torch.Tensor] = []
    rowwise: dict[str, list[torch.Tensor]] = {}
    other: Slots = {}
    for server in _holders(variables, name):
        client, start, rows = variables.clients[server], 0, None
        while rows is None or start < rows:
            fields, tensors = client.call({"op": "read", "name": name, "start": start, "budget": transport.chunk_bytes()})
            start, rows = fields["next"], fields["rows"]
            values.append(tensors.pop("value"))
            for key, tensor in tensors.items():
                kind, _, slot = key.partition("/")
                if kind == "slot":
                    rowwise.setdefault(slot, []).append(tensor)
                else:
                    other.setdefault(slot, tensor)
            for key, number in fields["scalars"].items():  # each server counts the steps that touched its rows
                other[key] = max(other.get(key, number), number)
    return torch.cat(values), {**other, **{k: torch.cat(v) for k, v in rowwise.items()}}


def push_variable(variables: ShardedVariables, name: str, value: torch.Tensor, slots: Slots | None) -> None:
    """Write a variable, and with ``slots`` replace its optimizer state, piece by piece."""
    rows = value.reshape(1) if value.dim() == 0 else value
    rowwise = {k: (v.reshape(1) if v.dim() == 0 else v) for k, v in (slots or {}).items() if isinstance(v, torch.Tensor) and v.shape == value.shape}
    bounds = variables.placement.row_bounds.get(name, [0, len(rows)])
    row_bytes = sum(t[:1].numel() * t.element_size() for t in [rows, *rowwise.values()])
    step = max(1, transport.chunk_bytes() // max(row_bytes, 1))
    for server in _holders(variables, name):
        lo, hi = (bounds[server], bounds[server + 1]) if name in variables.placement.row_bounds else (0, len(rows))
        for start in range(lo, hi, step):
            end = min(hi, start + step)
            fields: dict[str, Any] = {"op": "write", "name": name, "start": start - lo}
            tensors = {"value": rows[start:end], **{f"slot/{k}": v[start:end] for k, v in rowwise.items()}}
            if slots is not None and start == lo:
                fields["slots"] = {k: v for k, v in slots.items() if isinstance(v, (int, float))}
                tensors.update({f"whole/{k}": v for k, v in slots.items() if isinstance(v, torch.Tensor) and k not in rowwise})
            variables.clients[server].call(fields, tensors)


def plain_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], plain: nn.Module, extra: list[str]) -> torch.optim.Optimizer:
    """A torch optimizer of ``optimizer``'s class and groups on ``plain``'s parameters, its state
    initialized as torch's first step does (so every slot has torch's key and type).

    ``names``: the parameter name of each of ``optimizer``'s parameters (by id); ``extra``:
    parameters it does not hold (the tables, whose rows live on the servers), put in its first group.
    """
    params = dict(plain.named_parameters())
    groups = [{**g, "params": [params[names[id(p)]] for p in g["params"]]} for g in optimizer.param_groups]
    groups[0]["params"] += [params[n] for n in extra]
    out = type(optimizer)(groups, **optimizer.defaults)
    lrs = [g["lr"] for g in out.param_groups]
    with torch.no_grad():
        for g in out.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p) if p.requires_grad else None
        out.step()
        for g, lr in zip(out.param_groups, lrs):
            g["lr"] = lr
    out.zero_grad(set_to_none=True)
    return out


def to_torch(state: dict[str, Any], slots: Slots, shape: torch.Size) -> dict[str, Any] | None:
    """A parameter's torch state (as ``state``, initialized) holding the server's ``slots``; None when
    the server has no state for it yet (never updated)."""
    if not any(isinstance(v, torch.Tensor) for v in slots.values()):
        return None
    out = dict(state)
    for key, value in slots.items():
        torch_key = TORCH_KEYS.get(key, key)
        if torch_key not in state:
            continue
        if isinstance(state[torch_key], torch.Tensor):
            value = torch.as_tensor(value, dtype=state[torch_key].dtype).reshape(state[torch_key].shape if key == "step" else shape)
        out[torch_key] = value
    return out


def to_server(state: dict[str, Any]) -> Slots:
    """A parameter's torch optimizer state as the server keeps it (steps as numbers)."""
    slots: Slots = {"step": 0}
    for key, value in state.items():
        if key == "step":
            slots["step"] = int(value.item()) if isinstance(value, torch.Tensor) else int(value)
        elif isinstance(value, torch.Tensor):
            slots[SERVER_KEYS.get(key, key)] = value.detach()
    return slots
