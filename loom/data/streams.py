"""A token stream as parallel contiguous rows, for models that carry state between steps.

Truncated backpropagation through time keeps each row's hidden state from one step to the
next, so row i of a batch must continue row i of the previous batch, on the same replica.
``stream_batches(tokens, B, T)`` cuts the stream into B rows of equal length (the layout of
PyTorch's word-language-model example); global batch k holds, in row i, tokens
``i*L + k*T .. i*L + (k+1)*T - 1`` of the stream (L: a row's length) and, as targets, the same
positions one token on. Under ``strategy.distribute`` replica r always holds rows
``r*B/N .. (r+1)*B/N - 1``, so N replicas that each carry their rows' state train exactly as
one replica on the whole batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class TokenStreams(Dataset):
    """Sample ``k*B + i``: row i of step k, as ``(inputs, targets)`` of ``seq_len`` tokens each."""

    def __init__(self, tokens: Any, batch_size: int, seq_len: int) -> None:
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"stream_batches: {name} must be a positive integer, got {value!r}")
        tokens = torch.from_numpy(tokens) if isinstance(tokens, np.ndarray) else torch.as_tensor(tokens)
        if tokens.dim() != 1:
            raise ValueError(f"stream_batches takes a 1-D sequence of tokens, got shape {tuple(tokens.shape)}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.row_length = (len(tokens) - 1) // batch_size  # a row's inputs; its targets reach one further
        self.steps = self.row_length // seq_len
        if not self.steps:
            raise ValueError(
                f"stream_batches: {len(tokens)} tokens give {batch_size} rows of {self.row_length}, shorter than "
                f"seq_len={seq_len}; it needs at least batch_size*seq_len+1 = {batch_size * seq_len + 1} tokens"
            )

    def __len__(self) -> int:
        return self.steps * self.batch_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        step, row = divmod(index, self.batch_size)
        start = row * self.row_length + step * self.seq_len
        return self.tokens[start : start + self.seq_len], self.tokens[start + 1 : start + self.seq_len + 1]


def stream_batches(tokens: Any, batch_size: int, seq_len: int) -> TokenStreams:
    """``tokens`` laid out as ``batch_size`` contiguous rows read ``seq_len`` tokens a step.

    Pass the result to ``strategy.distribute`` (its global batch is ``batch_size``; it is never
    shuffled). Each row ends where the next begins, less the tokens that do not fill a step.
    """
    return TokenStreams(tokens, batch_size, seq_len)
