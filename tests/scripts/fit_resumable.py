"""loom.fit with checkpoints, slowed down so a test can kill or preempt it mid-run.

    fit_resumable.py OUT CKPT_DIR pipeline|dataset [EPOCHS]

Rank 1 appends "<restart> <pid> <step>" to OUT.progress after every step; rank 0 saves the
final parameters to OUT.pt.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import loom
import loom.data as ld
from loom.train import Callback
from tests.scripts.fit_job import data


class Slow(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_batch_end(self, state, loss) -> None:
        time.sleep(0.05)
        if state.strategy.replica_id == 1:
            with open(f"{self.out}.progress", "a") as f:
                f.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} {os.getpid()} {state.step}\n")


def main() -> None:
    out, checkpoints, kind = sys.argv[1], sys.argv[2], sys.argv[3]
    epochs = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    torch.manual_seed(0)
    train = data(400, 0)
    if kind == "pipeline":
        train = ld.from_tensors(*train.tensors).shuffle(seed=5).map(lambda row: row, num_parallel=2).batch(40)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 2))  # dropout: RNG matters
    loom.fit(model, F.cross_entropy, lambda p: torch.optim.Adam(p, lr=0.01), train, epochs=epochs, batch_size=40,
             checkpoint_dir=checkpoints, checkpoint_every=1, callbacks=[Slow(out)], progress=False)  # fmt: skip
    if loom.auto_strategy().is_chief:
        torch.save(model.state_dict(), f"{out}.pt")


if __name__ == "__main__":
    main()
