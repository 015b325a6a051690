"""A worker of a synchronous parameter-server job that saves the variables it ends with.

    ps_sync_final.py OUT STEPS [HOLD_AT]

Each worker appends "<worker> <pid> <step>" to OUT.progress after every step. With HOLD_AT,
every worker stops before that step as ``ps_train.py``'s do (OUT.held, then OUT.go). Once its
last round is applied on every server (so every worker's is), the chief writes every variable
with its optimizer slots, as the servers hold them, to OUT.final (``torch.save``).
"""

import os
import sys

import torch
import torch.nn.functional as F

import loom
from loom.strategies.parameter_server.checkpoints import pull_all
from tests.scripts.clicks import Clicks
from tests.scripts.ps_train import hold

ROWS = 200


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    hold_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    strategy = loom.auto_strategy()
    model, opt = strategy.prepare(Clicks(rows=ROWS), lambda p: torch.optim.Adagrad(p, lr=0.1))
    g = torch.Generator().manual_seed(strategy.replica_id)
    for step in range(strategy.step + 1, steps + 1):
        if step == hold_at:
            hold(out, strategy.replica_id)
        ids = torch.randint(0, ROWS, (16, 5), generator=g)
        loss = F.binary_cross_entropy_with_logits(model(ids), (ids % 7 == 0).any(1).float())
        strategy.backward(loss)
        opt.step()
        opt.zero_grad()
        with open(f"{out}.progress", "a") as f:
            f.write(f"{strategy.replica_id} {os.getpid()} {step}\n")
    if strategy.is_chief:
        torch.save(pull_all(strategy.variables), f"{out}.final")
    strategy.shutdown()


if __name__ == "__main__":
    main()
