"""Metrics: per-sample scores, and ``torchmetrics`` metrics synced over the replicas.

A function metric is ``fn(outputs, targets) -> Tensor[batch]``; its epoch value is the mean
over every real sample of every replica. A ``torchmetrics.Metric`` (or one of the common
names: precision, recall, f1, auroc, mae, mse) is updated with each replica's real samples
only, and its states are gathered over the replicas when computed, so each sample counts once.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable, Mapping, Union

import torch

from loom.strategies import Strategy
from loom.strategies.outputs import model_logits

Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def accuracy(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """1 where the highest-scoring class is the target (or, for one output, where sign matches a 0/1 target).

    ``outputs`` may be what a model computing its own loss returned: its logits are scored.
    """
    outputs = model_logits(outputs)
    if outputs.dim() == 1 or outputs.shape[-1] == 1:
        return ((outputs.reshape(-1) > 0).long() == targets.reshape(-1).long()).float()
    return (outputs.argmax(dim=-1) == targets).float()


METRICS: dict[str, Metric] = {"accuracy": accuracy}
# torchmetrics' class for each common name; classification ones take their task from the outputs
TORCHMETRICS = {"precision": "Precision", "recall": "Recall", "f1": "F1Score", "auroc": "AUROC", "mae": "MeanAbsoluteError", "mse": "MeanSquaredError"}
CLASSIFICATION = ("precision", "recall", "f1", "auroc")


def _is_torchmetric(m: Any) -> bool:
    torchmetrics = sys.modules.get("torchmetrics")  # an instance means it is imported: never import it for nothing
    return torchmetrics is not None and isinstance(m, torchmetrics.Metric)


def resolve_metrics(metrics: Union[None, Iterable[Any], Mapping[str, Any]]) -> dict[str, Any]:
    """Names, functions, ``torchmetrics.Metric``s or a name->metric mapping -> name->metric."""
    if metrics is None:
        return {}
    if isinstance(metrics, Mapping):
        return {name: _check(m) for name, m in metrics.items()}
    resolved: dict[str, Any] = {}
    for m in metrics:
        if isinstance(m, str):
            if m not in METRICS and m not in TORCHMETRICS:
                raise ValueError(f"unknown metric {m!r}; use one of {', '.join([*METRICS, *TORCHMETRICS])}, a function or a torchmetrics.Metric")
            resolved[m] = METRICS.get(m, m)
        else:
            resolved[getattr(m, "__name__", type(m).__name__)] = _check(m)
    return resolved


def _check(m: Any) -> Any:
    if _is_torchmetric(m) and not m.sync_on_compute:
        raise ValueError(f"loom syncs {type(m).__name__} over the replicas: create it without sync_on_compute=False")
    return m


def is_stateful(m: Any) -> bool:
    """Whether ``m`` is scored by ``SyncedMetric`` (a torchmetrics metric or its name) rather than summed per sample."""
    return isinstance(m, str) or _is_torchmetric(m)


class SyncedMetric:
    """One pass of a torchmetrics metric: a fresh copy fed this replica's real samples, synced by ``compute``."""

    def __init__(self, template: Any, strategy: Strategy) -> None:
        self.template, self.strategy = template, strategy
        self.metric: Any = None  # built at the first batch: a name's task comes from the outputs

    def update(self, outputs: Any, targets: torch.Tensor) -> None:
        preds = model_logits(outputs).detach()
        if self.metric is None:
            self.metric = self._build(preds)
        if preds.shape != targets.shape and preds.numel() == targets.numel():  # (N, 1) against (N,)
            preds = preds.reshape(targets.shape)
        if self.template in CLASSIFICATION:
            targets = targets.long()
        self.metric.update(preds, targets)

    def compute(self) -> float:
        if self.metric is None:
            raise ValueError(f"metric {self.template!r} saw no samples on replica {self.strategy.replica_id}: give every replica data")
        return float(self.metric.compute())

    def _build(self, preds: torch.Tensor) -> Any:
        import torchmetrics

        if isinstance(self.template, str):
            cls = getattr(torchmetrics, TORCHMETRICS[self.template])
            classes = 1 if preds.dim() == 1 else preds.shape[-1]
            task = {} if self.template not in CLASSIFICATION else {"task": "binary"} if classes == 1 else {"task": "multiclass", "num_classes": classes, "average": "macro"}
            metric = cls(**task)
        else:
            metric = self.template.clone()
            metric.reset()
        metric.dist_sync_fn = self._gather_each
        metric.distributed_available_fn = lambda: True
        return metric.to(preds.device)

    def _gather_each(self, tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        """torchmetrics' sync function on loom's gather: every replica's ``tensor`` (sizes may differ), in replica order."""
        rows = tensor.reshape(1) if tensor.dim() == 0 else tensor
        counts = self.strategy.gather(torch.tensor([rows.shape[0]], device=rows.device)).tolist()
        parts = self.strategy.gather(rows).split(counts)
        return [p.reshape(()) for p in parts] if tensor.dim() == 0 else list(parts)
