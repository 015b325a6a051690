"""Gradients summed across the replica groups while backward still runs (one process per group).

The buckets are laid out in the order backward fills them (the last layers' first). A bucket's
all-reduce starts as soon as backward has produced each of its gradients and every bucket before
it has gone: every group starts the same all-reduces in the same order whatever its timing, which
all-reduces over one process group need. A bucket that backward has not filled by the step's sync (a parameter
without a gradient, or one used before another bucket's) goes then, with zeros for the missing.

A second backward in one step (two losses, each with its own ``backward``) changes gradients
that were already sent: the step then waits for what it sent and sums everything again.
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
        self._spoiled = False

    def grad_ready(self, param: nn.Parameter) -> None:
        """Backward has accumulated ``param``'s gradient: send the buckets it completes, in turn."""
        if self._weight is None:
            return
        bucket = self._bucket_of[id(param)]
        if bucket < self._next or id(param) in self._ready[bucket]:
            self._spoiled = True  # a second backward in this step
            return
        self._ready[bucket].add(id(param))
        while self._next < len(self._buckets) and len(self._ready[self._next]) == len(self._buckets[self._next]):
            self._send_next()

    def finish(self) -> list[tuple[torch.Tensor, Any]] | None:
        """Every bucket sent, in order, with its work; None where the step must sum again (after
        waiting for what it sent) or sent nothing."""
        if self._weight is None:
            return None
        if self._spoiled:
            for _, work in self._sent:
                work.wait()
            self.begin(None)
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
