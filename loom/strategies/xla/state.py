"""The training state on the devices, and the user's module and optimizer kept in step with it.

Between steps the parameters, buffers and optimizer slots live on the XLA devices; copying
them back after every step would stall the device. The torch objects are brought up to date
when they are read: the module's ``parameters()``, ``buffers()`` (and their ``named_``
forms), its ``state_dict`` or an eager forward (evaluation), the optimizer's ``state_dict``
(so checkpoints see the trained values). A ``load_state_dict`` into either (a restore) sends
the host's values to the devices before the next step.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from loom.strategies.xla.mesh import MeshPlan
from loom.strategies.xla.optim import GroupRule, group_rules, slot_names


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A host array JAX takes: int64 as int32 (JAX's default), bfloat16 through float32."""
    t = t.detach().cpu()
    if t.dtype == torch.int64:
        t = t.to(torch.int32)
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


def to_torch(array: Any, like: torch.Tensor | None = None) -> torch.Tensor:
    """A device array as a host tensor (of ``like``'s dtype), gathered from every host if need be."""
    if not array.is_fully_addressable:
        from jax.experimental import multihost_utils

        array = multihost_utils.process_allgather(array, tiled=True)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.array(array.astype(np.float32))).to(torch.bfloat16 if like is None else like.dtype)
    host = torch.from_numpy(np.array(array))
    return host if like is None else host.to(like.dtype)


class DeviceState:
    """One module's parameters and buffers, and its optimizer's slots, placed on the mesh."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, plan: MeshPlan) -> None:
        self.module, self.optimizer, self.plan = module, optimizer, plan
        self.rules: tuple[GroupRule, ...] = group_rules(optimizer)
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        named = dict(nn.Module.named_parameters(module))
        self.group = {name: group_of[id(p)] for name, p in named.items() if id(p) in group_of and p.requires_grad}
        self.frozen_names = [name for name in named if name not in self.group]
        self.buffer_names = [name for name, _ in nn.Module.named_buffers(module)]
        self.params: dict[str, Any] = {}
        self.frozen: dict[str, Any] = {}
        self.buffers: dict[str, Any] = {}
        self.slots: dict[str, dict[str, Any]] = {}
        self.steps: dict[str, Any] = {}
        self.tracing = False  # the compiled step is calling the module: no syncing then
        self.device_newer = False  # trained on the devices since the host last saw it
        self.host_newer = True  # loaded on the host (or never sent)
        module.register_state_dict_pre_hook(lambda *_: self.download())
        module.register_forward_pre_hook(lambda *_: None if self.tracing else self.download())
        module.register_load_state_dict_post_hook(lambda *_: self.mark_host_newer())
        optimizer.register_state_dict_pre_hook(lambda *_: self.download())
        optimizer.register_load_state_dict_post_hook(lambda *_: self.mark_host_newer())
        self.watch(module)

    def watch(self, module: nn.Module) -> None:
        """``module.parameters()`` and ``buffers()`` (``named_`` too) read the trained values, not the first ones.

        torch has no hook for these reads, so the two methods that the four go through are
        wrapped on this module object (its class is left alone).
        """
        for name in ("named_parameters", "named_buffers"):
            object.__setattr__(module, name, _ReadCurrent(self, getattr(module, name)))

    def mark_host_newer(self) -> None:
        self.host_newer, self.device_newer = True, False

    def shardings(self) -> tuple[Any, Any, Any, Any, Any]:
        """(params, frozen, buffers, slots, steps) shardings, each a dict like the state."""
        plan = self.plan
        params = {n: plan.parameter(tuple(a.shape)) for n, a in self.params.items()}
        frozen = {n: plan.parameter(tuple(a.shape)) for n, a in self.frozen.items()}
        slots = {n: {s: params[n] for s in d} for n, d in self.slots.items()}
        return params, frozen, {n: plan.replicated() for n in self.buffers}, slots, {n: plan.replicated() for n in self.steps}

    def upload(self) -> None:
        """The host's parameters, buffers and optimizer state, onto the devices (when they changed there)."""
        if not self.host_newer:
            return
        import jax

        plan = self.plan
        named = dict(nn.Module.named_parameters(self.module))
        buffers = dict(nn.Module.named_buffers(self.module))
        put = lambda t: jax.device_put(to_numpy(t), plan.parameter(tuple(t.shape)))  # noqa: E731
        self.params = {n: put(named[n]) for n in self.group}
        self.frozen = {n: put(named[n]) for n in self.frozen_names}
        self.buffers = {n: jax.device_put(to_numpy(buffers[n]), plan.replicated()) for n in self.buffer_names}
        self.slots, self.steps = {}, {}
        for name, group in self.group.items():
            p, rule = named[name], self.rules[group]
            saved = self.optimizer.state.get(p, {})
            step = float(saved["step"]) if "step" in saved else float(bool(saved.get("momentum_buffer") is not None))
            self.slots[name] = {s: put(saved[s] if s in saved and saved[s] is not None else torch.zeros_like(p)) for s in slot_names(rule)}
            self.steps[name] = jax.device_put(np.float32(step), plan.replicated())
        self.host_newer = False

    def download(self) -> None:
        """The devices' values into the user's module and optimizer (after training, before a read)."""
        if not self.device_newer:
            return
        named = dict(nn.Module.named_parameters(self.module))
        buffers = dict(nn.Module.named_buffers(self.module))
        with torch.no_grad():
            for name, array in self.params.items():
                named[name].copy_(to_torch(array, named[name]))
            for name, array in self.buffers.items():
                buffers[name].copy_(to_torch(array, buffers[name]))
        for name, group in self.group.items():
            step = float(np.asarray(self.steps[name]))
            if step == 0:
                continue
            p, rule = named[name], self.rules[group]
            state = self.optimizer.state[p]
            for slot, array in self.slots[name].items():
                state[slot] = to_torch(array, p)
            if rule.kind == "adam":
                state["step"] = torch.tensor(step, dtype=torch.float32)
        self.device_newer = False


class _ReadCurrent:
    """A module's ``named_parameters``/``named_buffers`` that first brings the devices' values back."""

    def __init__(self, state: DeviceState, read: Callable[..., Any]) -> None:
        self.state, self.read = state, read

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.state.tracing:
            self.state.download()
        return self.read(*args, **kwargs)
