"""20 SGD-with-momentum steps on an MLP; the chief saves the final parameters.

Run as ``python train_mlp.py --strategy one_device --out p.pt`` or under ``loom run``.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import loom


def dataset(n: int = 640) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 0).long()) % 4
    return TensorDataset(x, y)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def train(strategy: loom.Strategy, batch_size: int = 32, accumulate: int = 1, epochs: int = 1) -> nn.Module:
    model, opt = strategy.prepare(mlp(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    loader = strategy.distribute(dataset(), batch_size=batch_size // accumulate, shuffle=True, seed=7)
    with strategy.accumulate(accumulate):
        for _ in range(epochs):
            for x, y in loader:
                strategy.backward(F.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad()
    return loom.unwrap(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="mirrored")
    parser.add_argument("--out", required=True)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--precision", default="32")
    parser.add_argument("--compression", default=None)
    args = parser.parse_args()
    options = {"precision": args.precision}
    if args.compression:
        options["compression"] = args.compression
    strategy = loom.get_strategy(args.strategy, **options)
    model = train(strategy, accumulate=args.accumulate)
    if strategy.is_chief:
        torch.save(model.state_dict(), args.out)


if __name__ == "__main__":
    main()
