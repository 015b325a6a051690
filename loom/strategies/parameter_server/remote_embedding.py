"""An embedding table that lives on the parameter servers: a forward pass pulls only the rows its
batch touches (or the rows the step's commit prefetched), and keeps them for the push."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.strategies.parameter_server.variables import ShardedVariables


class RemoteEmbedding(nn.Module):
    """An embedding table that lives on the servers; forward pulls only the rows it needs.

    It keeps the table's options: ``padding_idx`` (that row gets no gradient, and a bag leaves
    it out), ``scale_grad_by_freq``, a bag's ``mode`` and ``include_last_offset``; and whether
    it trains (``trained``: ``requires_grad``, and in the optimizer the user built).
    """

    def __init__(self, name: str, local: nn.Embedding | nn.EmbeddingBag, variables: ShardedVariables, trained: bool = True) -> None:
        super().__init__()
        self.name = name
        self.bag = isinstance(local, nn.EmbeddingBag)
        self.mode = getattr(local, "mode", None)
        self.padding_idx = local.padding_idx
        self.scale_grad_by_freq = local.scale_grad_by_freq
        self.include_last_offset = getattr(local, "include_last_offset", False)
        self.trained = trained and local.weight.requires_grad
        self.variables = variables  # not a submodule: a copy of the model shares it
        self.touched: list[tuple[torch.Tensor, torch.Tensor]] = []  # (row ids, pulled rows) of this step
        # [unique ids, their rows once read, the batch's ids, their places among the unique] of the batches to come
        self.ahead: deque[list[Any]] = deque(maxlen=2)

    def prefetch(self, ids: torch.Tensor) -> None:
        """Have the next read from the servers (the step's commit) bring the rows ``ids`` needs."""
        unique, inverse = torch.unique(ids, return_inverse=True)
        self.ahead.append([unique, None, ids.clone(), inverse])

    def wanted(self) -> torch.Tensor | None:
        """The ids of the newest prefetch not yet read, if any."""
        return self.ahead[-1][0] if self.ahead and self.ahead[-1][1] is None else None

    def prefetched(self, rows: torch.Tensor) -> None:
        self.ahead[-1][1] = rows

    def _lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The unique ids, each id's place among them, and their rows: prefetched when read for
        these ids (prefetches asked for before them are dropped), else pulled now. A prefetch
        for the batch after this one stays."""
        for i, (unique, rows, batch, inverse) in enumerate(self.ahead):
            if rows is not None and batch.shape == ids.shape and torch.equal(batch, ids):  # the unique ids without sorting again
                for _ in range(i + 1):
                    self.ahead.popleft()
                return unique, inverse, rows
        unique, inverse = torch.unique(ids, return_inverse=True)
        for i, (prefetched, rows, _, _) in enumerate(self.ahead):
            if rows is not None and torch.equal(prefetched, unique):
                for _ in range(i + 1):
                    self.ahead.popleft()
                return unique, inverse, rows
        return unique, inverse, self.variables.pull_rows(self.name, unique)

    def local_like(self, weight: torch.Tensor) -> nn.Module:
        """The plain module this one replaced, holding ``weight`` (for a checkpoint)."""
        options = {"freeze": not self.trained, "padding_idx": self.padding_idx, "scale_grad_by_freq": self.scale_grad_by_freq}
        if self.bag:
            return nn.EmbeddingBag.from_pretrained(weight, mode=self.mode, include_last_offset=self.include_last_offset, **options)
        return nn.Embedding.from_pretrained(weight, **options)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        unique, local_ids, rows = self._lookup(ids)
        if torch.is_grad_enabled() and self.trained:  # kept for the push; evaluation keeps nothing
            self.touched.append((unique, rows.requires_grad_()))
        padding = None  # the padding row's place among the pulled rows, if the batch has it
        if self.padding_idx is not None and bool((hit := unique == self.padding_idx).any()):
            padding = int(hit.nonzero()[0])
        if self.bag:
            return F.embedding_bag(local_ids, rows, offsets, scale_grad_by_freq=self.scale_grad_by_freq, mode=self.mode,
                                   per_sample_weights=per_sample_weights, include_last_offset=self.include_last_offset,
                                   padding_idx=padding)  # fmt: skip
        return F.embedding(local_ids, rows, padding_idx=padding, scale_grad_by_freq=self.scale_grad_by_freq)

    def row_gradients(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's row ids and their gradients, summed over forward passes."""
        parts = [(ids, rows.grad) for ids, rows in self.touched if rows.grad is not None]
        self.touched = []
        if not parts:
            return None
        if len(parts) == 1:  # the ids as read: the push splits them among the servers as the read did
            return parts[0]
        return torch.cat([ids for ids, _ in parts]), torch.cat([g for _, g in parts])
