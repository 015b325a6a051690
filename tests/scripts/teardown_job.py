"""A short DDP job whose ranks finish at different times: the case that can abort at teardown.

Once DDP is built, PyTorch keeps the gloo group alive to the interpreter's C++ teardown; a
rank that exits while another still runs is where "terminate called" used to appear.
"""

import time

import torch
from torch import nn

import loom


def main() -> None:
    strategy = loom.MirroredStrategy()
    model, opt = strategy.prepare(nn.Linear(8, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    strategy.backward(model(torch.randn(4, 8)).sum())
    opt.step()
    total = strategy.reduce(torch.ones(1), "sum")
    assert int(total) == strategy.num_replicas_in_sync, total
    if strategy.replica_id == 0:
        time.sleep(0.2)  # the others leave first


if __name__ == "__main__":
    loom.launch(main)
