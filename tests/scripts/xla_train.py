"""A plain training script under TPUStrategy, for `loom xla export` (which stops it at its first step)."""

import torch
import torch.nn.functional as F

import loom
from tests.contract.cases import data, mlp, sgd


def main() -> None:
    strategy = loom.TPUStrategy()
    model, opt = strategy.prepare(mlp(), sgd)
    step = strategy.train_step(model, F.cross_entropy, opt)
    for x, y in strategy.distribute(data(), batch_size=16):
        step(x, y)
    torch.save(loom.unwrap(model).state_dict(), "should-not-be-written.pt")


if __name__ == "__main__":
    main()
