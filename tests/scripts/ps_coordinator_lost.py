"""A ClusterCoordinator job whose chief is lost between two rounds of steps.

    ps_coordinator_lost.py OUT

Every process schedules a round of two steps and joins, then a second round. After the first
round the chief writes its pid to OUT.chief and waits there to be killed, as if its machine
went down (the test kills its launcher and it, kill -9: no launcher is left to tell the
servers). The worker then waits for the second round, which the chief never scheduled.
"""

import os
import sys
import time

import torch
from torch import nn

import loom

HOLD_LIMIT = 120.0  # seconds the chief waits for its kill before it fails (the test gives up sooner)


def main() -> None:
    out = sys.argv[1]
    strategy = loom.ParameterServerStrategy()
    model, opt = strategy.prepare(nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    coordinator = loom.ClusterCoordinator(strategy)

    def step_fn(step: int) -> int:
        model(torch.ones(4, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
        return step

    for round_ in range(2):
        for step in range(2):
            coordinator.schedule(step_fn, args=(2 * round_ + step,))
        coordinator.join()
        if strategy.is_chief:
            with open(f"{out}.chief.tmp", "w") as f:
                f.write(f"{os.getpid()}\n")
            os.replace(f"{out}.chief.tmp", f"{out}.chief")
            time.sleep(HOLD_LIMIT)
            raise SystemExit(f"chief {os.getpid()}: not killed within {HOLD_LIMIT:g}s")


if __name__ == "__main__":
    main()
