"""Optimizers that run on the parameter servers, dense and lazily sparse.

A server applies each pushed gradient to the variables it holds, so the update rule lives
here rather than on the workers. For embedding rows the update is lazy, as TensorFlow's
LazyAdam and torch's SparseAdam: only the rows a batch touched have their state updated.
Dense updates match ``torch.optim.SGD``/``Adagrad``/``Adam``; sparse Adam matches
``torch.optim.SparseAdam`` (tests compare them step by step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

OPTIMIZERS = ("sgd", "momentum", "adagrad", "adam")


@dataclass
class ServerOptimizer:
    """One rule with its hyper-parameters, and the state of every variable it updates."""

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    initial_accumulator: float = 0.0
    state: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown server optimizer {self.name!r}; choose one of: {', '.join(OPTIMIZERS)}")

    def apply_dense(self, key: str, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Update all of ``param`` in place."""
        self._update(key, param, grad, None)

    def apply_rows(self, key: str, table: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Update only ``rows`` of ``table`` in place; repeated rows have their gradients summed first."""
        unique, inverse = torch.unique(rows, return_inverse=True)
        summed = torch.zeros(len(unique), *grads.shape[1:], dtype=grads.dtype).index_add_(0, inverse, grads)
        self._update(key, table, summed, unique)

    def _update(self, key: str, param: torch.Tensor, grad: torch.Tensor, rows: torch.Tensor | None) -> None:
        state = self.state.setdefault(key, {"step": 0})
        state["step"] += 1
        view = param if rows is None else param[rows]
        if self.name == "sgd":
            view = view - self.lr * grad
        elif self.name == "momentum":
            buf = self._slot(state, "momentum", param, rows, fill=0.0) * self.momentum + grad  # first: the gradient
            self._store(state, "momentum", param, rows, buf)
            view = view - self.lr * buf
        elif self.name == "adagrad":
            acc = self._slot(state, "sum", param, rows, fill=self.initial_accumulator) + grad * grad
            self._store(state, "sum", param, rows, acc)
            view = view - self.lr * grad / (acc.sqrt() + self.eps)
        else:  # adam; sparse rows use the variable's step count, as SparseAdam does
            beta1, beta2 = self.betas
            m = self._slot(state, "exp_avg", param, rows, fill=0.0) * beta1 + (1 - beta1) * grad
            v = self._slot(state, "exp_avg_sq", param, rows, fill=0.0) * beta2 + (1 - beta2) * grad * grad
            self._store(state, "exp_avg", param, rows, m)
            self._store(state, "exp_avg_sq", param, rows, v)
            step = state["step"]
            denom = (v / (1 - beta2**step)).sqrt() + self.eps
            view = view - self.lr / (1 - beta1**step) * m / denom
        if rows is None:
            param.copy_(view)
        else:
            param[rows] = view

    @staticmethod
    def _slot(state: dict[str, Any], name: str, param: torch.Tensor, rows: torch.Tensor | None, fill: float) -> torch.Tensor:
        if name not in state:
            state[name] = torch.full_like(param, fill)
        return state[name] if rows is None else state[name][rows]

    @staticmethod
    def _store(state: dict[str, Any], name: str, param: torch.Tensor, rows: torch.Tensor | None, value: torch.Tensor) -> None:
        if rows is None:
            state[name] = value
        else:
            state[name][rows] = value
