"""Click-through-rate prediction on parameter servers, with a known ground truth to score against.

    loom run --ps 2 --workers 2 examples/ctr_parameter_server.py     # asynchronous, parameter servers
    loom run --ps 2 --workers 2 --sync examples/ctr_parameter_server.py  # synchronous, parameter servers
    loom run --nproc 2 examples/ctr_parameter_server.py              # synchronous, MirroredStrategy

Each sample is a bag of 20 feature ids drawn from a Zipf distribution (exponent 1.1, as ids in
click logs are) over 100,000 ids. A hidden "true" model (an embedding per id, summed, then a
linear score) decides each click's probability, so the best AUC any model can reach is known.
The script trains an embedding-bag + MLP model on 200,000 samples (CTR_SAMPLES sets another
number), whatever the strategy, and prints its AUC on held-out samples next to the true model's.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch import nn
from torch.utils.data import TensorDataset

import loom

IDS, BAG, TRUE_DIM = 100_000, 20, 8
SAMPLES = int(os.environ.get("CTR_SAMPLES", "200000"))


def make_data(samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ids, clicks, and the true click probabilities (same hidden model for every seed)."""
    truth = torch.Generator().manual_seed(1234)
    embedding = torch.randn(IDS, TRUE_DIM, generator=truth) * 0.3
    weights = torch.randn(TRUE_DIM, generator=truth)
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy((rng.zipf(1.1, size=(samples, BAG)) - 1) % IDS)
    probability = torch.sigmoid(embedding[ids].sum(1) @ weights - 1.0)
    clicks = torch.bernoulli(probability, generator=torch.Generator().manual_seed(seed)).float()
    return ids, clicks, probability


class CTRModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(IDS, 16, mode="sum")
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.bag(ids)).squeeze(1)


def main() -> None:
    strategy = loom.auto_strategy()
    model, opt = strategy.prepare(CTRModel(), lambda p: torch.optim.Adagrad(p, lr=0.05))
    ids, clicks, _ = make_data(SAMPLES, seed=0)
    for x, y in strategy.distribute(TensorDataset(ids, clicks), batch_size=512, shuffle=True):
        loss = F.binary_cross_entropy_with_logits(model(x), y)
        strategy.backward(loss)
        opt.step()
        opt.zero_grad()
    if strategy.is_chief:
        test_ids, test_clicks, truth = make_data(20_000, seed=1)
        with torch.no_grad():
            scores = torch.cat([model(chunk) for chunk in test_ids.split(2048)])
        auc, best = roc_auc_score(test_clicks, scores), roc_auc_score(test_clicks, truth)
        print(f"{type(strategy).__name__}: test AUC {auc:.4f} (the true model's: {best:.4f})", flush=True)
    strategy.shutdown()


if __name__ == "__main__":
    main()
