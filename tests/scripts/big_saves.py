"""Save step 1, then ever bigger saves until killed: for killing a process in the middle of a save."""

import sys

import torch
from torch import nn

import loom

strategy = loom.OneDeviceStrategy()
model = nn.Linear(4, 2)
strategy.save(sys.argv[1], step=1, model=model, note="small")
for step in range(2, 100):
    strategy.save(sys.argv[1], step=step, model=model, blob=torch.ones(100_000_000 // 4))  # 100 MB
