"""Two replicas; rank 1 stops inside the job's first save, where the other waits for it in C++
(the checkpoint's process group being made), and writes its pid so that a test can kill it there."""

import os
import sys
import threading
from pathlib import Path

import torch.distributed as dist
from torch import nn

import loom

out = Path(sys.argv[1])
strategy = loom.MultiWorkerMirroredStrategy()  # one host or two
model = strategy.prepare(nn.Linear(4, 2))


def stop_here(*args, **kwargs):
    (out / "rank1.pid").write_text(str(os.getpid()))
    threading.Event().wait()  # until killed


if strategy.replica_id == 1:
    dist.new_group = stop_here
strategy.save(out / "ckpt", model=model)
