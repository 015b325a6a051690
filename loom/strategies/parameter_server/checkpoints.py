"""The servers' variables and optimizer slots as a plain model and a torch optimizer, and back.

A parameter-server checkpoint is an ordinary loom checkpoint of the model as the user built
it (tables included) and of a torch optimizer of the user's class holding the servers' slots,
so it restores under any strategy, and any strategy's checkpoint restores here. Variables
move in pieces of at most ``transport.chunk_bytes()``: no message exceeds the limit, however
large a server's share of a table.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from loom.errors import CheckpointMismatchError
from loom.strategies.base import unwrap
from loom.strategies.optimizer import inner_optimizer
from loom.strategies.parameter_server import transport
from loom.strategies.parameter_server.variables import ShardedVariables

Slots = dict[str, Any]
Pulled = dict[str, tuple[torch.Tensor, Slots]]  # variable -> (value, slots)


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
    shaped = {k: v for k, v in (slots or {}).items() if isinstance(v, torch.Tensor) and v.shape == value.shape}
    rowwise = {k: v.reshape(1) if v.dim() == 0 else v for k, v in shaped.items()}
    bounds = variables.placement.row_bounds.get(name)
    row_bytes = sum(t[:1].numel() * t.element_size() for t in [rows, *rowwise.values()])
    step = max(1, transport.chunk_bytes() // max(row_bytes, 1))
    for server in _holders(variables, name):
        lo, hi = (bounds[server], bounds[server + 1]) if bounds else (0, len(rows))
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
    accepted = inspect.signature(type(optimizer)).parameters  # AdamW keeps a default its constructor does not take
    out = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
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


def to_torch(state: dict[str, Any], slots: Slots) -> dict[str, Any]:
    """A parameter's torch optimizer state (``state``: as torch's first step made it) with the
    server's ``slots`` in it; as it is where the server has none yet (never updated)."""
    out = dict(state)
    for key, value in slots.items():
        if key in state and isinstance(state[key], torch.Tensor):  # the servers keep torch's slot names
            out[key] = torch.as_tensor(value, dtype=state[key].dtype).reshape(state[key].shape)
        elif key in state:
            out[key] = value
    return out


def to_server(state: dict[str, Any]) -> Slots:
    """A parameter's torch optimizer state as the server keeps it (steps as numbers)."""
    slots: Slots = {"step": 0}
    for key, value in state.items():
        if key == "step":
            slots["step"] = int(value.item()) if isinstance(value, torch.Tensor) else int(value)
        elif isinstance(value, torch.Tensor):
            slots[key] = value.detach()
    return slots


def pull_all(variables: ShardedVariables) -> Pulled:
    return {name: pull_variable(variables, name) for name in [*variables.placement.dense, *variables.placement.row_bounds]}


def _server_optimizer(value: Any, variables: ShardedVariables) -> Any:
    """The parameter-server optimizer in ``value`` (it holds these variables), or None."""
    inner = inner_optimizer(value) if isinstance(value, torch.optim.Optimizer) else None
    return inner if getattr(inner, "variables", None) is variables else None


def plain_state(variables: ShardedVariables, options: dict[str, Any], pulled: Pulled | None) -> dict[str, Any]:
    """``options`` with each model as a plain copy (tables in place) and each parameter-server
    optimizer as a torch optimizer on that copy: holding ``pulled`` (the servers' values and
    slots), or, without, of the right shapes to restore into. Other values pass as they are."""
    copies: dict[int, nn.Module] = {}
    out: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, nn.Module):
            copies[id(unwrap(value))] = out[key] = _plain_model(variables, unwrap(value), pulled)
    tables = {f"{name}.weight": name for name in variables.placement.row_bounds}
    for key, value in options.items():
        optimizer = _server_optimizer(value, variables)
        if optimizer is None:
            out.setdefault(key, value)
            continue
        if id(optimizer.model) not in copies:
            raise CheckpointMismatchError(
                "an optimizer is saved and restored with its model: pass both, e.g. save(dir, model=model, optimizer=opt)"
            )
        plain = copies[id(optimizer.model)]
        names = {id(p): n for n, p in optimizer.model.named_parameters()}
        out[key] = opt = plain_optimizer(optimizer.optimizer, names, plain, list(tables))
        for name, parameter in plain.named_parameters() if pulled else ():
            opt.state[parameter] = to_torch(opt.state[parameter], pulled[tables.get(name, name)][1])
    return out


def _plain_model(variables: ShardedVariables, model: nn.Module, pulled: Pulled | None) -> nn.Module:
    """A copy of ``model`` (sharing the connection to the servers) with each table a local
    embedding: the servers' values from ``pulled``, or just its shape."""
    plain = copy.deepcopy(model, {id(variables): variables})
    for name, bounds in variables.placement.row_bounds.items():
        if pulled is None:
            weight = torch.empty(bounds[-1], variables.pull_rows(name, torch.arange(min(bounds[-1], 1))).shape[1])
        else:
            weight = pulled[name][0]
        plain.set_submodule(name, plain.get_submodule(name).local_like(weight))
    with torch.no_grad():
        for name, parameter in plain.named_parameters():
            if pulled is not None and name in variables.placement.dense:
                parameter.copy_(pulled[name][0].reshape(parameter.shape))
    return plain


def write_back(variables: ShardedVariables, state: dict[str, Any], options: dict[str, Any]) -> None:
    """Every variable of the restored plain models to the servers, with its optimizer's slots
    when an optimizer was restored too."""
    optimizers = {
        id(p): opt for opt in state.values() if isinstance(opt, torch.optim.Optimizer) for g in opt.param_groups for p in g["params"]
    }
    tables = {f"{name}.weight": name for name in variables.placement.row_bounds}
    for key, plain in state.items():
        if not isinstance(options.get(key), nn.Module):
            continue
        for name, parameter in plain.named_parameters():
            variable = tables.get(name, name)
            if variable in variables.placement.dense or variable in variables.placement.row_bounds:
                opt = optimizers.get(id(parameter))
                push_variable(variables, variable, parameter.detach(), to_server(opt.state.get(parameter, {})) if opt else None)


def mirror(variables: ShardedVariables, state: dict[str, Any], options: dict[str, Any]) -> None:
    """The user's optimizers hold the restored state of their parameters, as under other
    strategies (the servers update from their own copy)."""
    for key, value in options.items():
        optimizer = _server_optimizer(value, variables)
        if optimizer is None:
            continue
        for mine, theirs in zip(optimizer.param_groups, state[key].param_groups):  # the plain one's tables come last
            for parameter, plain in zip(mine["params"], theirs["params"]):
                restored = state[key].state[plain]
                optimizer.state[parameter] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in restored.items()}
