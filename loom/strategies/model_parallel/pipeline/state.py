"""What a pipeline stage saves and restores: its own tensors, under the whole model's names.

A checkpoint written by the stages together is the whole model's, so it restores under
OneDevice or Mirrored, and theirs restores into the stages. Each stage hands the checkpoint a
view of the modules it owns at their paths in the model, and an optimizer view whose
parameter groups also name the other stages' parameters (meta placeholders, left out of the
model's state dict): the groups' hyper-parameters are written once, by the first process,
and must name every parameter so that every stage, and one device, finds its own.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from loom.compat import non_persistent_buffers
from loom.strategies.optimizer import inner_optimizer


def stage_view(model: nn.Module, owned: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose state dict is ``owned`` (this stage's tensors) under their names in ``model``."""
    view = nn.Module()
    for name, tensor in owned.items():
        path, _, leaf = name.rpartition(".")
        holder = _container(view, path)
        source = model.get_submodule(path) if path else model
        if isinstance(tensor, nn.Parameter):
            holder.register_parameter(leaf, tensor)
        else:
            holder.register_buffer(leaf, tensor, persistent=leaf not in non_persistent_buffers(source))
    return view


def held_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers of ``model`` this process holds (not meta: another stage's), by name."""
    return {name: t for name, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta}


def _container(root: nn.Module, path: str) -> nn.Module:
    module = root
    for part in path.split(".") if path else []:
        if part not in dict(module.named_children()):
            module.add_module(part, nn.Module())
        module = module.get_submodule(part)
    return module


class NamedGroups(torch.optim.Optimizer):
    """The stage's optimizer as the checkpoint sees it: its state, and groups naming every stage's parameters.

    A torch ``Optimizer`` (for DCP's checks) over copies of the stage optimizer's groups with the
    placeholders appended; ``state`` is the stage optimizer's own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, placeholders: list[list[nn.Parameter]]) -> None:
        inner = inner_optimizer(optimizer)
        super().__init__([{**g, "params": [*g["params"], *extra]} for g, extra in zip(inner.param_groups, placeholders)], inner.defaults)
        self.optimizer = inner
        self.placeholders = {id(p) for group in placeholders for p in group}
        self.state = inner.state

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index.setdefault(id(p), len(index)) for p in group["params"]]
            groups.append(packed)
        state = {index[id(p)]: s for p, s in self.optimizer.state.items() if id(p) in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loaded by name (DCP's form): the placeholders' names are dropped, the stage's own loaded."""
        groups = []
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            keep = [key for p, key in zip(group["params"], saved["params"]) if id(p) not in self.placeholders]
            groups.append({**saved, "params": keep})
        kept = {key for g in groups for key in g["params"]}
        self.optimizer.load_state_dict({"state": {k: v for k, v in state_dict["state"].items() if k in kept}, "param_groups": groups})

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The stage optimizer's step under these groups' hyper-parameters: DCP creates missing state
        by a step with their ``lr`` set to 0, which must not move the parameters."""
        groups = self.optimizer.param_groups
        kept = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        for group, mine in zip(groups, self.param_groups):
            group.update({k: v for k, v in mine.items() if k != "params"})
        try:
            return self.optimizer.step(closure)
        finally:
            for group, saved in zip(groups, kept):
                group.update(saved)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def named_groups(view: nn.Module, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None) -> NamedGroups:
    """``optimizer`` with every stage's parameters named in its groups (a collective over the pp group)."""
    names = {id(p): n for n, p in view.named_parameters()}
    mine = [[names[id(p)] for p in g["params"]] for g in inner_optimizer(optimizer).param_groups]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    placeholders, hidden = [], []
    for g, own in enumerate(mine):
        others = [n for theirs in everyone for n in theirs[g] if n not in own]
        placeholders.append([_placeholder(view, n) for n in others])
        hidden += others

    def hide(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name in hidden:
            state.pop(prefix + name, None)

    view.register_state_dict_post_hook(hide)
    return NamedGroups(optimizer, placeholders)


def _placeholder(view: nn.Module, name: str) -> nn.Parameter:
    """A meta parameter standing for another stage's, so the optimizer's groups can name it."""
    path, _, leaf = name.rpartition(".")
    holder = _container(view, path)
    param = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
    holder.register_parameter(leaf, param)
    return param
