"""The explicit training loop on one device: the reference every other strategy must match.

    python examples/one_device_digits.py
"""

import os

import torch
import torch.nn.functional as F

import loom
from mirrored_digits import DigitsCNN, digits

EPOCHS = int(os.environ.get("DIGITS_EPOCHS", "8"))  # the tests train fewer: they check that it learns, not how well


def main(strategy: loom.Strategy, epochs: int = EPOCHS) -> float:
    torch.manual_seed(0)
    train, test = digits()
    model, opt = strategy.prepare(DigitsCNN(), lambda p: torch.optim.Adam(p, lr=2e-3))
    loader = strategy.distribute(train, batch_size=64)
    for epoch in range(epochs):
        for x, y in loader:
            strategy.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    result = loom.evaluate(model, F.cross_entropy, test, batch_size=64, strategy=strategy, metrics=["accuracy"])
    if strategy.is_chief:
        print(f"{type(strategy).__name__}, {strategy.num_replicas_in_sync} replica(s): test accuracy: {result['accuracy']:.2f}")
    return result["accuracy"]


if __name__ == "__main__":
    main(loom.OneDeviceStrategy())
