"""Save step 1, then start a big asynchronous save of step 2 and train on, until killed."""

import sys
import time

import torch
from torch import nn

import loom
from loom import compat

strategy = loom.OneDeviceStrategy()
model = nn.Linear(4, 2)
strategy.save(sys.argv[1], step=1, model=model, note="small")
strategy.save(sys.argv[1], step=2, async_save=True, model=model, blob=torch.ones(300_000_000 // 4))  # 300 MB
print(compat.checkpoint_process().pid, flush=True)
while True:
    model(torch.randn(8, 4)).sum().backward()
    time.sleep(0.001)
