"""A ClusterCoordinator job whose steps each add exactly 1 to a counter on the servers.

    ps_coordinated.py OUT STEPS

The chief schedules STEPS steps and joins; every process then fetches every step's result,
and the chief writes them, with the counter as the servers and its own model hold it, to
OUT.json. Worker 2's first process stops in its second step after the step's update is
applied (before it gives the result) and writes "<pid> <step>" to OUT.after (steps are numbered in the order scheduled); its successor
stops in its first step before its push and writes OUT.before. There they wait to be killed
(the test does it with kill -9). Worker 1's steps wait until OUT.after exists, so that
worker 2 gets two steps.
"""

import json
import os
import sys
import time

import torch
from torch import nn

import loom

HOLD_LIMIT = 120.0  # seconds a stopped worker waits for its kill before it fails (the test gives up sooner)


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.count = nn.Parameter(torch.zeros(1))


def stop_here(path: str, step: int) -> None:
    with open(f"{path}.tmp", "w") as f:
        f.write(f"{os.getpid()} {step}\n")
    os.replace(f"{path}.tmp", path)
    time.sleep(HOLD_LIMIT)  # the test kills this process meanwhile
    raise SystemExit(f"worker {os.getpid()}: not killed within {HOLD_LIMIT:g}s")


def wait_for(path: str) -> None:
    give_up = time.monotonic() + HOLD_LIMIT
    while not os.path.exists(path):
        if time.monotonic() > give_up:
            raise SystemExit(f"no {path} within {HOLD_LIMIT:g}s")
        time.sleep(0.05)


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    strategy = loom.ParameterServerStrategy()
    model, opt = strategy.prepare(Counter(), lambda p: torch.optim.SGD(p, lr=1.0))
    coordinator = loom.ClusterCoordinator(strategy)
    per_worker = coordinator.create_per_worker_dataset(lambda ctx: range(ctx.input_pipeline_id, 10**6, ctx.num_input_pipelines))
    iterator = iter(per_worker)
    successor = os.path.exists(f"{out}.after")
    ran = []

    def step_fn(it, step):
        sample = next(it)
        ran.append(sample)
        if strategy.worker == 1:
            wait_for(f"{out}.after")
        if strategy.worker == 2 and successor and len(ran) == 1:
            stop_here(f"{out}.before", step)
        (-model.count.sum()).backward()  # SGD with lr 1: each applied step adds 1
        opt.step()
        opt.zero_grad()
        if strategy.worker == 2 and not successor and len(ran) == 2:
            stop_here(f"{out}.after", step)
        return {"step": step, "worker": strategy.worker, "sample": sample, "count": model.count.detach().clone()}

    results = [coordinator.schedule(step_fn, args=(iterator, step)) for step in range(steps)]
    coordinator.join()
    fetched = coordinator.fetch(results)
    if strategy.is_chief:
        servers = strategy.variables.pull_dense(["count"])["count"].item()
        report = {"servers": servers, "chief_model": model.count.item(), "done": coordinator.done(),
                  "results": [{**r, "count": r["count"].item()} for r in fetched]}  # fmt: skip
        with open(f"{out}.json", "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
