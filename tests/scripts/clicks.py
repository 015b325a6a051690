"""The small click model the parameter-server tests and scripts train: an embedding bag and an MLP."""

import torch
from torch import nn


class Clicks(nn.Module):
    """Seeded in its constructor, so every copy starts with the same weights."""

    def __init__(self, rows: int = 50) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(rows, 8, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.bag(ids)).squeeze(1)
