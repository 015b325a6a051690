"""A worker of a parameter-server job: train a small click model, log each step.

    ps_train.py OUT STEPS [DIE_AT [HOLD_AT]]

With DIE_AT (0: never), worker 1's first process kills itself (SIGKILL) in the middle of that
step's push: staged on every server, committed on the first only. With HOLD_AT, every worker
process stops before that step, appends "<worker> <pid>" to OUT.held and waits for OUT.go, so
a test can act on a job that is still running at a known point. Each worker process appends
"<worker> <pid> <OMP_NUM_THREADS> <LOOM_THREADS> <torch threads>" to OUT.threads when it
starts and "<worker> <pid> <step>" to OUT.progress after every step; the chief, when done,
waits for the others' files and writes each server's counts (pushes applied per worker
process, version, last synchronous round) to OUT.stats.
"""

import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import loom
from tests.scripts.clicks import Clicks

HOLD_LIMIT = 240.0  # seconds a held worker waits for OUT.go before it fails (the test gives up sooner)


def die_mid_push(variables, marker: str) -> None:
    """The next push is staged everywhere and committed on the first server only; then SIGKILL."""
    open(marker, "w").close()

    def commit_once_then_die(servers, *reads):
        variables.clients[servers[0]].call({"op": "commit", "worker": variables.worker, "seq": variables.clock})
        os.kill(os.getpid(), signal.SIGKILL)

    variables._commit = commit_once_then_die


def hold(out: str, worker: int) -> None:
    with open(f"{out}.held", "a") as f:
        f.write(f"{worker} {os.getpid()}\n")
    give_up = time.monotonic() + HOLD_LIMIT
    while not os.path.exists(f"{out}.go"):
        if time.monotonic() > give_up:
            raise SystemExit(f"worker {worker}: no {out}.go within {HOLD_LIMIT:g}s")
        time.sleep(0.05)


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    die_at = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    hold_at = int(sys.argv[4]) if len(sys.argv) > 4 else None
    strategy = loom.auto_strategy()
    with open(f"{out}.threads", "a") as f:
        env = [os.environ.get(k, "-") for k in ("OMP_NUM_THREADS", "LOOM_THREADS")]
        f.write(f"{strategy.replica_id} {os.getpid()} {env[0]} {env[1]} {torch.get_num_threads()}\n")
    model, opt = strategy.prepare(Clicks(rows=1000), lambda p: torch.optim.Adagrad(p, lr=0.1))
    g = torch.Generator().manual_seed(strategy.replica_id)
    for step in range(strategy.step + 1, steps + 1):  # synchronous: a restarted worker resumes at the job's round
        if step == hold_at:
            hold(out, strategy.replica_id)
        ids = torch.randint(0, 1000, (32, 5), generator=g)
        loss = F.binary_cross_entropy_with_logits(model(ids), (ids % 7 == 0).any(1).float())
        strategy.backward(loss)
        if step == die_at and strategy.replica_id == 1 and not os.path.exists(f"{out}.died"):
            die_mid_push(strategy.variables, f"{out}.died")
        opt.step()
        opt.zero_grad()
        with open(f"{out}.progress", "a") as f:
            f.write(f"{strategy.replica_id} {os.getpid()} {step}\n")
        time.sleep(0.02)
    with open(f"{out}.done.{strategy.replica_id}", "w") as f:
        f.write(str(os.getpid()))
    if strategy.is_chief:
        while not all(os.path.exists(f"{out}.done.{w}") for w in range(strategy.num_replicas_in_sync)):
            time.sleep(0.1)
        stats = [c.call({"op": "stats"})[0] for c in strategy.variables.clients]
        with open(f"{out}.stats", "w") as f:
            json.dump(stats, f)
    strategy.shutdown()


if __name__ == "__main__":
    main()
