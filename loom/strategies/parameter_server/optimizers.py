"""The user's torch optimizer, run by the parameter servers on the variables they hold.

A server applies each pushed gradient with torch's own optimizer class and the hyper-parameters
of the parameter group the variable belongs to (sent again with every push, so LR schedulers
reach the servers). One torch optimizer per variable: pushes that touch different variables
run at once, each under its variable's lock.

Embedding tables are exact by default: a step on a table is torch's dense step on the server's
rows, untouched rows included (momentum and Adam keep moving them, weight decay shrinks them),
so N synchronous workers equal one device. Where the rule leaves untouched rows alone (SGD
without momentum or weight decay, Adagrad without weight decay) only the pushed rows are
stepped, which is the same result for less work. ``lazy_rows`` steps only the pushed rows for
every rule, as TensorFlow's LazyAdam and torch's SparseAdam do: a row's slots (momentum, Adam's
moments, Adagrad's sum) start at zero (Adagrad: its initial accumulator) and change only when the
row is pushed; the step count (Adam's bias correction) is the table's, counted on every push.
RMSprop and Adadelta decay their averages of squares on every step, so an exact table steps
every row each push, as torch's dense step does.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

RULES: dict[str, type[torch.optim.Optimizer]] = {
    "SGD": torch.optim.SGD,
    "Adagrad": torch.optim.Adagrad,
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
    "RMSprop": torch.optim.RMSprop,
    "Adadelta": torch.optim.Adadelta,
}
RUNTIME_OPTIONS = ("foreach", "fused", "capturable", "differentiable")  # how torch computes, not what: the server decides


@dataclass
class ServerOptimizer:
    """One rule (a torch optimizer class), its parameter groups, and which group each variable is in.

    ``groups``: each group's hyper-parameters (``lr``, ``momentum``, ...); ``assign``: variable
    name -> group index (0 when not named). ``state`` (not a field: kept out of the rule's
    description) maps a variable to its slots, torch's names, and ``step``, the updates it got.
    """

    kind: str = "SGD"
    groups: list[dict[str, Any]] = field(default_factory=lambda: [{"lr": 0.01}])
    assign: dict[str, int] = field(default_factory=dict)
    lazy_rows: bool = False

    def __post_init__(self) -> None:
        if self.kind not in RULES:
            raise ValueError(f"unknown server optimizer {self.kind!r}; choose one of: {', '.join(RULES)}")
        self.state: dict[str, dict[str, Any]] = {}
        self._torch: dict[str, torch.optim.Optimizer] = {}  # one per variable, built on its first step
        self._grads: dict[str, torch.Tensor] = {}  # exact tables: a dense gradient buffer each

    def hyper(self, key: str, groups: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The hyper-parameters of ``key``'s group: as pushed (``groups``), else as created."""
        group = (groups or self.groups)[self.assign.get(key, 0)]
        return {k: tuple(v) if isinstance(v, list) else v for k, v in group.items()}

    def apply_dense(self, key: str, param: torch.Tensor, grad: torch.Tensor, groups: list[dict[str, Any]] | None = None) -> None:
        """One torch step of all of ``param``, in place."""
        hyper = self.hyper(key, groups)
        optimizer = self._torch.get(key)
        if optimizer is None or optimizer.param_groups[0]["params"][0] is not param:
            optimizer = self._torch[key] = _build(self.kind, param, hyper)
        slots = self.state.setdefault(key, {"step": 0})
        if _tensor_slots(slots):  # ``state`` is the truth (a checkpoint may have replaced it): torch steps its slots
            optimizer.state[param] = {**_tensor_slots(slots), "step": torch.tensor(float(slots["step"]))}
        optimizer.param_groups[0].update(hyper)
        param.grad = grad
        try:
            optimizer.step()
        finally:
            param.grad = None
        self._keep(key, optimizer.state[param])

    def apply_rows(
        self, key: str, table: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, groups: list[dict[str, Any]] | None = None
    ) -> None:
        """One step of a table from the gradients of some of its rows (repeated rows are summed).

        Exact: torch's dense step of the whole table, unless the rule leaves rows without a
        gradient where they are. Lazy: a step of the pushed rows only (see the module's doc).
        """
        hyper = self.hyper(key, groups)
        if not self.lazy_rows and _moves_untouched_rows(self.kind, hyper):
            dense = self._grads.get(key)
            if dense is None or dense.shape != table.shape:  # kept: a fresh 64 MB of zeros each push costs more than the step
                dense = self._grads[key] = torch.zeros_like(table)
            try:
                self.apply_dense(key, table, dense.index_add_(0, rows, grads.to(table.dtype)), groups)
            finally:
                dense.zero_()  # whole: torch may step in the gradient itself (SGD's nesterov does)
            return
        unique, summed = _summed_rows(rows, grads.to(table.dtype))
        slots = self.state.setdefault(key, {"step": 0})
        if not _tensor_slots(slots):
            slots.update(_fresh_slots(self.kind, table, hyper))
        view = table.index_select(0, unique)  # a copy: stepped on its own, then written back
        optimizer = _build(self.kind, view, hyper)
        rowwise = _tensor_slots(slots)
        optimizer.state[view] = {**{k: v.index_select(0, unique) for k, v in rowwise.items()}, "step": torch.tensor(float(slots["step"]))}
        view.grad = summed
        optimizer.step()
        table.index_copy_(0, unique, view)  # index_select/index_copy_: several times faster than tensor indexing
        for name, value in optimizer.state[view].items():
            if name in rowwise:
                rowwise[name].index_copy_(0, unique, value)
        slots["step"] += 1

    def _keep(self, key: str, torch_state: dict[str, Any]) -> None:
        slots = self.state.setdefault(key, {"step": 0})
        slots.update({k: v for k, v in torch_state.items() if k != "step" and isinstance(v, torch.Tensor)})
        slots["step"] += 1


def _build(kind: str, param: torch.Tensor, hyper: dict[str, Any]) -> torch.optim.Optimizer:
    """torch's optimizer for one tensor; options its constructor does not take (AdamW's
    ``decoupled_weight_decay``) go straight into the group."""
    accepted = _accepted(kind)
    optimizer = RULES[kind]([param], **{k: v for k, v in hyper.items() if k in accepted})
    optimizer.param_groups[0].update(hyper)
    return optimizer


@functools.cache
def _accepted(kind: str) -> frozenset[str]:
    """The options the rule's constructor takes (read once: a lazy-rows step builds an optimizer each push)."""
    return frozenset(inspect.signature(RULES[kind].__init__).parameters)


def _summed_rows(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows, increasing, and each one's gradient summed over its repeats (from zero).

    A worker pushes its batch's sorted unique ids, so the rows usually come increasing: then
    each sum is ``0 + g``, the same numbers ``index_add_`` gives, without sorting the ids
    again or scattering (on W3 that was a fifth of a lazy step on a loaded machine).
    """
    if len(rows) < 2 or bool((rows[1:] > rows[:-1]).all()):
        return rows, torch.zeros_like(grads).add_(grads)
    unique, inverse = torch.unique(rows, return_inverse=True)
    return unique, torch.zeros(len(unique), *grads.shape[1:], dtype=grads.dtype).index_add_(0, inverse, grads)


def _tensor_slots(slots: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in slots.items() if isinstance(v, torch.Tensor)}


def _moves_untouched_rows(kind: str, hyper: dict[str, Any]) -> bool:
    """Whether a zero gradient still moves a row or its slots: momentum, Adam's moments, weight
    decay, RMSprop's and Adadelta's decaying averages."""
    if kind == "SGD":
        return bool(hyper.get("momentum") or hyper.get("weight_decay"))
    if kind == "Adagrad":
        return bool(hyper.get("weight_decay"))
    return True


def _fresh_slots(kind: str, table: torch.Tensor, hyper: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A lazily stepped table's slots before any push, in torch's names."""
    if kind == "SGD":
        return {"momentum_buffer": torch.zeros_like(table)} if hyper.get("momentum") else {}
    if kind == "Adagrad":
        return {"sum": torch.full_like(table, float(hyper.get("initial_accumulator_value", 0.0)))}
    if kind == "RMSprop":
        names = ["square_avg", *(["momentum_buffer"] if hyper.get("momentum") else []), *(["grad_avg"] if hyper.get("centered") else [])]
    elif kind == "Adadelta":
        names = ["square_avg", "acc_delta"]
    else:
        names = ["exp_avg", "exp_avg_sq", *(["max_exp_avg_sq"] if hyper.get("amsgrad") else [])]
    return {name: torch.zeros_like(table) for name in names}
