"""``loom.predict``: a model's outputs for every sample of a data set, once each and in order.

Each replica runs its slice of every global batch and keeps the real samples (not the padding
of an uneven last batch). Replica r's slice of batch k is the r-th contiguous part of that
batch (``loom.data.sharding``), so laying the real samples out batch by batch, replica by
replica, restores the data's order. Two gathers at the end do it: the outputs, and each
replica's count per batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loom.strategies import Strategy, auto_strategy
from loom.strategies.step import slice_batch


def _inputs(batch: Any) -> Any:
    """Keras' rule: a tuple or list is ``(inputs, targets[, weights])``; anything else is the inputs."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


@torch.no_grad()
def predict(model: nn.Module, data: Any, *, batch_size: int | None = None, strategy: Strategy | None = None) -> torch.Tensor:
    """``model``'s outputs for all of ``data``, in the data's order, on every replica (on the CPU).

    ``data`` is what ``strategy.distribute`` takes (a tensor of inputs too); ``batch_size`` is
    the global batch. ``model`` is one returned by ``strategy.prepare``, or a plain module run
    on ``strategy.device``. Its output must be one tensor whose first dimension is the batch.
    """
    strategy = strategy or auto_strategy()
    model = model.to(strategy.device)
    loader = strategy.distribute(data, batch_size, shuffle=False)
    was_training = model.training
    model.eval()
    outputs, counts = [], []
    for k, batch in enumerate(loader):
        out = model(_inputs(batch))
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"predict gathers one tensor per batch; the model returned {type(out).__name__}: wrap it to return a tensor")
        n = loader.valid_count(k)
        outputs.append(slice_batch(out, 0, n))
        counts.append(n)
    model.train(was_training)
    if not outputs:
        raise ValueError("predict got no batches: the data is empty")
    return _in_order(strategy, torch.cat(outputs), counts)


def _in_order(strategy: Strategy, mine: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every replica's real outputs, laid out batch by batch and, within a batch, replica by replica."""
    per_replica = strategy.gather(torch.tensor(counts, device=mine.device)).view(-1, len(counts)).tolist()
    every = strategy.gather(mine).cpu().split([sum(c) for c in per_replica])
    chunks = [part.split(c) for part, c in zip(every, per_replica)]
    return torch.cat([chunks[r][k] for k in range(len(counts)) for r in range(len(chunks))])
