"""A tiny job for ``loom scale``: an MLP trained with fit on random data, more steps than asked for."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import loom


def main() -> None:
    data = TensorDataset(torch.randn(2048, 16), torch.randint(0, 4, (2048,)))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    loom.fit(model, F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.1), data, batch_size=32, epochs=1, progress=False)
    raise SystemExit("the job ran to its end: loom scale should have stopped it")


if __name__ == "__main__":
    main()
