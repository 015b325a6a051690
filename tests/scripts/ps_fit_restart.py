"""``loom.fit(checkpoint_dir=...)`` on a parameter-server job whose only worker is killed once.

    ps_fit_restart.py OUT

It checkpoints every 3 steps; its first process saves the servers' state (values and optimizer
slots) to OUT.before after step 5 and kills itself (SIGKILL). The launcher restarts it; fit
restores the checkpoint of step 3, and the successor saves the servers' state, as it finds it
then, to OUT.after before going on.
"""

import os
import signal
import sys

import torch
import torch.nn.functional as F

import loom
from loom.strategies.parameter_server.checkpoints import pull_all
from loom.train.callbacks import Callback
from tests.scripts.clicks import Clicks

KILL_AFTER = 5


class Snapshots(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def _save(self, state, suffix: str) -> None:
        torch.save({n: (v, s) for n, (v, s) in pull_all(state.strategy.variables).items()}, f"{self.out}.{suffix}")

    def on_train_begin(self, state) -> None:
        if os.path.exists(f"{self.out}.before"):
            self._save(state, "after")

    def on_batch_end(self, state, loss) -> None:
        if state.step == KILL_AFTER and not os.path.exists(f"{self.out}.before"):
            self._save(state, "before")
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (16 * 8, 5), generator=g)
    data = torch.utils.data.TensorDataset(ids, (ids % 7 == 0).any(1).float())
    loom.fit(Clicks(rows=100), F.binary_cross_entropy_with_logits, lambda p: torch.optim.Adagrad(p, lr=0.1), data,
             epochs=2, batch_size=16, progress=False, checkpoint_dir=f"{out}.ckpt", checkpoint_every=3,
             callbacks=[Snapshots(out)])  # fmt: skip


if __name__ == "__main__":
    main()
