"""Trains 4 replicas for a long time, each writing its pid, so a test can kill one."""

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import loom


def main() -> None:
    pid_dir = sys.argv[1]
    strategy = loom.MirroredStrategy()
    model, opt = strategy.prepare(nn.Linear(8, 2), lambda p: torch.optim.SGD(p, lr=0.01))
    for step in range(100_000):
        x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
        strategy.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
        if step == 3:
            with open(os.path.join(pid_dir, f"rank{strategy.replica_id}.pid"), "w") as f:
                f.write(str(os.getpid()))
        time.sleep(0.02)


if __name__ == "__main__":
    loom.launch(main)
