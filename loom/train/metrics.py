"""Metrics as per-sample scores, so averaging over replicas (and past padding) is exact.

A metric is ``fn(outputs, targets) -> Tensor[batch]``; its epoch value is the mean over every
real sample of every replica.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Union

import torch

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


def resolve_metrics(metrics: Union[None, Iterable[str | Metric], Mapping[str, Metric]]) -> dict[str, Metric]:
    """Names, functions or a name->function mapping -> name->function."""
    if metrics is None:
        return {}
    if isinstance(metrics, Mapping):
        return dict(metrics)
    resolved: dict[str, Metric] = {}
    for m in metrics:
        if isinstance(m, str):
            if m not in METRICS:
                raise ValueError(f"unknown metric {m!r}; use one of {', '.join(METRICS)} or pass a function")
            resolved[m] = METRICS[m]
        else:
            resolved[getattr(m, "__name__", "metric")] = m
    return resolved
