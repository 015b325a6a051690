"""Synchronous training on parameter servers: one round's gradients, summed over the workers that gave.

A server keeps a ``Round`` per round still waiting for workers (``server.py``) and applies its
mean once every worker still in the job has given its share.
"""

from __future__ import annotations

from typing import Any

import torch


class Round:
    """Synchronous training: the gradients of one round, summed over the workers that gave."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.workers: set[str] = set()
        self.dense: dict[str, torch.Tensor] = {}
        self.rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.hyper: list[dict[str, Any]] | None = None  # the round's hyper-parameters, as its shares carry them

    @classmethod
    def restored(cls, expected: int, workers: list[str], sums: dict[str, torch.Tensor]) -> Round:
        """A round as a checkpoint kept it: its sums so far, and who gave them."""
        pending = cls(expected)
        pending.add("", sums)
        pending.workers = set(workers)
        return pending

    def add(self, worker: str, tensors: dict[str, torch.Tensor], hyper: list[dict[str, Any]] | None = None) -> None:
        if worker in self.workers:
            return
        self.workers.add(worker)
        self.hyper = hyper or self.hyper
        for key, value in tensors.items():
            kind, name = key.split("/", 1)
            if kind == "grad":
                self.dense[name] = self.dense[name] + value if name in self.dense else value.clone()
            elif kind == "rowgrad":
                self.rows.setdefault(name, []).append((tensors[f"rowids/{name}"], value))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The round's sums as one push (repeated rows are summed when applied)."""
        out = {f"grad/{name}": grad for name, grad in self.dense.items()}
        for name, parts in self.rows.items():
            out[f"rowids/{name}"] = torch.cat([ids for ids, _ in parts])
            out[f"rowgrad/{name}"] = torch.cat([grads for _, grads in parts])
        return out

    def mean(self) -> dict[str, torch.Tensor]:
        """The update synchronous training applies: the mean over the workers that gave."""
        share = 1.0 / len(self.workers)
        return {key: value if key.startswith("rowids/") else value * share for key, value in self.tensors().items()}
