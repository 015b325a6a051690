"""The optimizer a worker steps: ``step()`` pushes the gradients to the servers, which run the
user's own optimizer (``server_rule`` describes it to them), and pulls the newest parameters."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from loom.compat import leave_step_unwrapped
from loom.strategies.optimizer import share_state
from loom.strategies.parameter_server.optimizers import RULES, RUNTIME_OPTIONS
from loom.strategies.parameter_server.remote_embedding import RemoteEmbedding
from loom.strategies.parameter_server.variables import ShardedVariables
from loom.strategies.precision import Precision


class ParameterServerOptimizer(torch.optim.Optimizer):
    """``step()`` pushes this worker's gradients and pulls the newest dense parameters.

    The servers run the user's own optimizer (see ``optimizers.py``), each parameter group with
    the hyper-parameters it has at this step, so the training loop and its LR scheduler do not
    change. Inside ``strategy.accumulate(k)`` only the last micro-batch's ``step`` pushes (and
    ``zero_grad`` clears), and fp16 gradients, the pulled rows' included, go through the
    strategy's gradient scaler, which skips a push whose gradients overflowed.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        model: nn.Module,
        variables: ShardedVariables,
        workers: int,
        staleness: int | None,
        synchronous: bool = False,
        trained: Iterable[str] | None = None,
        precision: Precision | None = None,
        should_step: Any = lambda: True,
        lazy_rows: bool = False,
    ) -> None:
        super().__init__(inner.param_groups, inner.defaults)  # torch's hook tables and checks
        self.optimizer = inner
        share_state(self, inner)  # the LR scheduler's changes reach the servers through the user's optimizer
        self.model = model
        self.variables = variables
        self.workers = workers
        self.staleness = staleness
        self.synchronous = synchronous
        self.precision = precision
        self.lazy_rows = lazy_rows
        self._should_step = should_step
        self.dense = {n: p for n, p in model.named_parameters()}
        self.trained = list(self.dense) if trained is None else [n for n in trained if n in self.dense]  # in the optimizer
        self.tables = [m for m in model.modules() if isinstance(m, RemoteEmbedding)]
        self.remote = {m.name: m for m in self.tables if m.trained}

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._should_step():
            self.model.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's: its state is the servers' as of the last ``restore`` (they keep the live one)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    @leave_step_unwrapped
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if not self._should_step():
            return None
        return self._update(closure)

    @torch.optim.Optimizer.profile_hook_step  # runs the step hooks around each push, as torch's optimizers do
    def _update(self, closure: Any = None) -> Any:
        scaler = self.precision.scaler if self.precision is not None else None
        if closure is not None and scaler is not None:
            raise ValueError("precision='16-mixed' does not support optimizer closures (e.g. LBFGS); use 'bf16-mixed'")
        loss = None
        if closure is not None:  # as torch's optimizers do: the closure computes the gradients first
            with torch.enable_grad():
                loss = closure()
        if scaler is None:
            self._push()
            return loss
        rows = [pulled for m in self.remote.values() for _, pulled in m.touched]
        scaler.step(_Gradients([self.dense[n] for n in self.trained] + rows, self._push))
        for m in self.remote.values():
            m.touched = []  # a skipped step's rows are not pushed with the next one
        return loss

    def _push(self) -> None:
        dense = {n: g for n in self.trained if (g := self.dense[n].grad) is not None}
        rows = {name: g for name, m in self.remote.items() if (g := m.row_gradients()) is not None}
        options = {"hyper": group_hyper(self.optimizer), "every_shard": not self.lazy_rows}
        ahead = {m: ids for m in self.tables if (ids := m.wanted()) is not None}  # prefetched rows: read with the dense ones
        wanted = {m.name: ids for m, ids in ahead.items()}
        if self.synchronous or self.staleness is not None:
            self.variables.push(dense, rows, sync=self.workers if self.synchronous else None, **options)
            if self.synchronous:
                self.variables.wait_for_round()
            else:
                self.variables.wait_for_peers(self.workers, self.staleness)
            pulled, fetched = self.variables.pull(list(self.dense), wanted)  # after the step every worker waits for
        else:  # asynchronous: the newest parameters come back with the commit
            pulled, fetched = self.variables.push(dense, rows, then_pull=list(self.dense), then_rows=wanted, **options)
        for name, value in pulled.items():
            self.dense[name].copy_(value)
        for module in ahead:
            if module.name in fetched:
                module.prefetched(fetched[module.name])


class _Gradients:
    """What the fp16 gradient scaler unscales and checks for overflow: the dense gradients and
    the pulled rows'; its ``step`` is the push."""

    def __init__(self, params: list[torch.Tensor], push: Any) -> None:
        self.param_groups = [{"params": params}]
        self.step = push


def server_rule(optimizer: torch.optim.Optimizer, assign: dict[str, int] | None = None, lazy_rows: bool = False) -> dict[str, Any]:
    """The servers' copy of a torch optimizer the user built: its class, every parameter group's
    hyper-parameters, and which group each variable (by name) is in.

    torch's SparseAdam is Adam with lazy rows, which is what it does on a table.
    """
    if isinstance(optimizer, torch.optim.SparseAdam):
        return {"kind": "Adam", "groups": group_hyper(optimizer), "assign": assign or {}, "lazy_rows": True}
    kind = next((k for k, cls in RULES.items() if type(optimizer) is cls), None)
    if kind is None:
        raise ValueError(
            f"{type(optimizer).__name__} cannot run on the parameter servers; use SGD (any momentum, dampening, nesterov, "
            "weight decay), Adagrad, Adam or AdamW (amsgrad, weight decay), RMSprop (alpha, momentum, centered, weight decay), "
            "Adadelta, or torch's SparseAdam"
        )
    return {"kind": kind, "groups": group_hyper(optimizer), "assign": assign or {}, "lazy_rows": lazy_rows}


def group_hyper(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every parameter group's hyper-parameters as they are now (a scheduler changes them), as JSON."""
    keys = [k for k in optimizer.defaults if k not in RUNTIME_OPTIONS]
    return [{k: _plain(group[k]) for k in keys if k in group} for group in optimizer.param_groups]


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
