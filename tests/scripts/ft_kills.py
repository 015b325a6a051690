"""A replica group's script for the kill tests: ft_train's model, data, schedule and clipping, steps paced by the test.

``ft_kills.py OUT``: each committed step is appended to OUT/steps.jsonl (batch, groups, sample ids) and
each process saves its final weights as OUT/final-<group>-<rank>.pt, as ft_train does. The test holds
the pen:

- ``OUT/allow`` holds a number of batches: a group takes the quorum of the job's batch b only once
  it is above b, so the test decides when each step may start (healed groups included);
  OUT/allow-G, while it exists, does so for group G alone. OUT/asking-G says the batch group G
  last asked a quorum for.
- ``PARK=G:B,...``: group G's first life stops in the middle of batch B's step (after its forward
  pass would run, before the sync), writes its pid (group, life) to OUT/parked-G and waits to be killed.
- ``GATE=G:R,...``: life R of group G (its R-th restart) joins only once OUT/join-G-R exists.
- ``TRIP_LOAD=G:R``: life R of group G stops while it reads a heal's state (its pid in OUT/parked-G).
- ``OUT/trip-send``, while it exists: the next process that serves a heal stops in the middle of the
  response (the HTTP headers sent, the state's bytes not yet) and writes its pid, group and life there.
- ``OUT/quorum-G-R`` counts the quorum requests life R of group G has sent.

The send trip is in the scheduler's state (``Tripwire``), which torchft pickles into the response of
the group serving a heal (it arrives as an empty OrderedDict: loom loads a heal's tensors and plain
values only); the load trip wraps loom's ``load_heal``, once it has read part of the response.
"""

import importlib.util
import json
from collections import OrderedDict
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import loom
from loom.strategies.data_parallel import fault_tolerant
from loom.strategies.data_parallel.fault_tolerant import load_heal

spec = importlib.util.spec_from_file_location("ft_train", Path(__file__).with_name("ft_train.py"))
ft_train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ft_train)

OUT = Path(sys.argv[1])
ft_train.registered(OUT)
GROUP, RESTART = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def _pairs(name: str) -> set[tuple[int, int]]:
    return {tuple(map(int, p.split(":"))) for p in os.environ.get(name, "").split(",") if p}


def _park(path: Path) -> None:
    """Say where this process is (its pid, group and life in ``path``) and wait to be killed."""
    path.write_text(f"{os.getpid()} {GROUP} {RESTART}")
    while True:
        time.sleep(0.05)


def _load_tripping(stream):
    """loom's ``load_heal`` in the healing group, which life R of group G stops in the middle of."""
    if (GROUP, RESTART) in _pairs("TRIP_LOAD"):
        stream.read(64)
        _park(OUT / f"parked-{GROUP}")
    return load_heal(stream)


fault_tolerant.load_heal = _load_tripping


class Tripwire:
    def __reduce__(self):  # pickled by the group serving a heal, after the response's headers
        flag = OUT / "trip-send"
        if flag.exists() and not flag.read_text():
            _park(flag)
        return (OrderedDict, ())


class TrippingStepLR(torch.optim.lr_scheduler.StepLR):
    def state_dict(self) -> dict:
        return {**super().state_dict(), "tripwire": Tripwire()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != "tripwire"})


def _allowed() -> int:
    path = OUT / f"allow-{GROUP}" if (OUT / f"allow-{GROUP}").exists() else OUT / "allow"
    text = path.read_text() if path.exists() else ""
    return int(text) if text.strip() else 0


def paced(strategy, loader):
    """The loader's batches, each asked for (its quorum taken) only once OUT/allow is above the job's next batch."""
    batches = iter(loader)
    while True:
        while _allowed() <= strategy.committed_batches():
            time.sleep(0.02)
        (OUT / f"asking-{GROUP}").write_text(str(strategy.committed_batches()))
        try:
            yield next(batches)
        except StopIteration:
            return


def _say_when_asking() -> None:
    """Count this life's quorum requests in OUT/quorum-G-R: until a group's request is sent, a quorum may form without it."""
    send = loom.compat._RecordingClient._quorum
    marker = OUT / f"quorum-{GROUP}-{RESTART}"
    sent = 0

    def _quorum(self, *args, **kwargs):
        nonlocal sent
        sent += 1
        marker.write_text(str(sent))
        return send(self, *args, **kwargs)

    loom.compat._RecordingClient._quorum = _quorum


def main() -> None:
    _say_when_asking()
    if (GROUP, RESTART) in _pairs("GATE"):
        while not (OUT / f"join-{GROUP}-{RESTART}").exists():
            time.sleep(0.05)
    strategy = loom.auto_strategy()
    rank = strategy.cluster.rank
    model, opt = strategy.prepare(ft_train.make_model(GROUP + 1), ft_train.optimizer)
    sched = TrippingStepLR(opt, step_size=3, gamma=0.5)
    step = strategy.train_step(model, F.cross_entropy, opt, scheduler=sched, max_grad_norm=ft_train.MAX_NORM)
    loader = strategy.distribute(ft_train.Numbered(), batch_size=ft_train.BATCH, shuffle=True)
    with open(OUT / "steps.jsonl", "a") as log:
        for _ in range(ft_train.EPOCHS):
            for x, y, ids in paced(strategy, loader):
                m = strategy.membership
                if RESTART == 0 and (GROUP, m.batch) in _pairs("PARK"):
                    _park(OUT / f"parked-{GROUP}")
                step(x, y)
                if not strategy.committed:
                    continue
                log.write(json.dumps({"g": GROUP, "rank": rank, "pid": os.getpid(), "restart": RESTART, "batch": m.batch, "groups": m.groups, "ids": ids.tolist()}) + "\n")
                log.flush()
    torch.save(loom.unwrap(model).state_dict(), OUT / f"final-{GROUP}-{rank}.pt")
    (OUT / f"lr-{GROUP}-{rank}.json").write_text(json.dumps(ft_train.schedule_state(opt, sched)))


if __name__ == "__main__":
    main()
