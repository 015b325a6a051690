"""Gradients summed across the replica groups while backward still runs (one process per group).

The buckets are laid out in the reverse order of the parameters, the order backward usually fills
them. A bucket's all-reduce starts as soon as backward has produced each of its gradients and every
bucket before it has gone: every group starts the same all-reduces, one per bucket, in the same
order whatever its timing, which all-reduces over one process group need. A bucket that backward has
not filled by the step's sync (a parameter without a gradient, or a model whose gradients come in
another order) goes then, with zeros for the missing.

Only ``train_step`` sends during backward: its last micro-batch's backward is the step's only one,
and nothing changes the gradients between it and the update. In the eager loop a second backward
or the user's own edit of a gradient may come after backward, so every bucket goes at the step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

Flatten = Callable[[list[nn.Parameter], float], torch.Tensor]  # a bucket's gradients times a weight, flat
Send = Callable[[torch.Tensor], Any]  # an all-reduce started; its work has wait()


class EarlySums:
    """One step's buckets: which of their gradients backward has produced, and what was sent."""

    def __init__(self, buckets: list[list[nn.Parameter]], flatten: Flatten, send: Send) -> None:
        self._buckets = buckets
        self._bucket_of = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
        self._flatten = flatten
        self._send = send
        self.begin(None)

    def begin(self, weight: float | None) -> None:
        """A new step, whose gradients count ``weight`` times (this group's share of the batch); None: no step."""
        self._weight = weight
        self._ready: list[set[int]] = [set() for _ in self._buckets]
        self._next = 0  # the bucket to send next
        self._sent: list[tuple[torch.Tensor, Any]] = []  # (flat, work), in bucket order

    def grad_ready(self, param: nn.Parameter) -> None:
        """Backward has accumulated ``param``'s gradient: send the buckets it completes, in turn."""
        if self._weight is None:
            return
        self._ready[self._bucket_of[id(param)]].add(id(param))
        while self._next < len(self._buckets) and len(self._ready[self._next]) == len(self._buckets[self._next]):
            self._send_next()

    def finish(self) -> list[tuple[torch.Tensor, Any]] | None:
        """Every bucket sent, in order, with its work (those backward did not complete go now); None outside a step."""
        if self._weight is None:
            return None
        while self._next < len(self._buckets):
            self._send_next()
        sent = self._sent
        self.begin(None)
        return sent

    def _send_next(self) -> None:
        assert self._weight is not None
        flat = self._flatten(self._buckets[self._next], self._weight)
        self._sent.append((flat, self._send(flat)))
        self._next += 1
