"""Strategies one after another, each killed with kill -9 between two saves, then preempted, then finished.

    loom run --nproc 2 --max-restarts 1 kill_matrix_job.py DIR STRATEGY[,STRATEGY...]

Each strategy goes through three stages, recorded in ``DIR/<strategy>/stage``; every launch
runs the script from the top, and a strategy that finished is skipped:

0. ``loom.fit`` saving every ``EVERY`` steps; after step ``KILL_AT`` (between two saves) the
   last rank kills itself with SIGKILL, and torchrun's agent restarts every process;
1. the restarted fit resumes from the last checkpoint; after step ``TERM_AT`` every rank
   writes its state to ``killed-<rank>.pt`` and the last rank sends itself SIGTERM: every
   rank saves after that step and the job exits 0;
2. the next launch resumes from that save and finishes (``resumed-<rank>.pt``); then the same
   processes train a fresh model the same way with no checkpoints at all (the uninterrupted
   run), writing its state after step ``TERM_AT`` and at the end (``reference-*-<rank>.pt``).

A state is this rank's parameters and optimizer tensors (a sharded one's whole, a pipeline
stage's own).
"""

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import loom
from loom.train import Callback
from tests.scripts.fit_job import data

EPOCHS, STEPS_PER_EPOCH, BATCH = 2, 5, 16
EVERY, KILL_AT, TERM_AT = 2, 3, 7  # saves after steps 2, 4, 5 (the epoch's end), 6 and 8
OPTIONS = {  # what a strategy needs on two processes
    "hybrid": {"mesh": {"dp": 1, "tp": 2}},
    "local_sgd": {"sync_every": 3},  # syncs after steps 3, 6 and 9: every save, the kill and the SIGTERM fall mid-period
    "diloco": {"sync_every": 3},
    "diloco_overlap": {"sync_every": 3, "overlap_sync": True},  # a mean in flight at every save after step 3
}
REGISTERED = {"diloco_overlap": "diloco"}  # this script's name for a strategy with options -> the registry's


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def last_rank() -> bool:
    return rank() == (dist.get_world_size() if dist.is_initialized() else 1) - 1


class Snapshot(Callback):
    """After step ``at``: writes this rank's state to ``path``; then, with ``signum``, the last rank writes the
    stage the job will be at and sends itself the signal."""

    def __init__(self, at: int, path: Path | None = None, signum: int | None = None, stage: tuple[Path, int] | None = None) -> None:
        self.at, self.path, self.signum, self.stage = at, path, signum, stage
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def on_batch_end(self, state, loss) -> None:
        if state.step != self.at:
            return
        if self.path is not None:
            torch.save(local_state(self.model, self.optimizer), self.path)
        if self.signum is not None and last_rank():
            self.stage[0].write_text(str(self.stage[1]))
            os.kill(os.getpid(), self.signum)


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    names = {p: n for n, p in model.named_parameters()}
    state = {f"param.{n}": p for n, p in model.named_parameters()}
    state.update({f"optim.{names[p]}.{k}": v for p, s in optimizer.state.items() for k, v in s.items()})
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}
    return {k: v.detach().clone() for k, v in whole.items() if not v.is_meta}


def train(strategy: loom.Strategy, checkpoints: Path | None, snapshot: Snapshot) -> dict[str, torch.Tensor]:
    """A fresh model, with dropout and Adam, trained by ``fit``; this rank's final state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 2))
    snapshot.model = model

    def adam(params):
        snapshot.optimizer = torch.optim.Adam(params, lr=0.02)
        return snapshot.optimizer

    loom.fit(model, F.cross_entropy, adam, data(STEPS_PER_EPOCH * BATCH, 0), epochs=EPOCHS, batch_size=BATCH, strategy=strategy,
             checkpoint_dir=checkpoints and str(checkpoints), checkpoint_every=EVERY, callbacks=[snapshot], progress=False)  # fmt: skip
    return local_state(model, snapshot.optimizer)


def run(name: str, directory: Path) -> None:
    """Take ``name`` one stage further, or to the end from the last."""
    stage_file, checkpoints = directory / "stage", directory / "checkpoints"
    stage = int(stage_file.read_text()) if stage_file.exists() else 0
    if stage == 3:
        return
    directory.mkdir(parents=True, exist_ok=True)
    strategy = loom.get_strategy(REGISTERED.get(name, name), timeout=30, **OPTIONS.get(name, {}))
    if stage == 0:
        train(strategy, checkpoints, Snapshot(KILL_AT, signum=signal.SIGKILL, stage=(stage_file, 1)))
        raise AssertionError(f"{name}: the last rank was not killed after step {KILL_AT}")
    if stage == 1:
        train(strategy, checkpoints, Snapshot(TERM_AT, directory / f"killed-{rank()}.pt", signal.SIGTERM, (stage_file, 2)))
        raise AssertionError(f"{name}: not preempted after step {TERM_AT}")
    torch.save(train(strategy, checkpoints, Snapshot(0)), directory / f"resumed-{rank()}.pt")
    reference = train(strategy, None, Snapshot(TERM_AT, directory / f"reference-{TERM_AT}-{rank()}.pt"))
    torch.save(reference, directory / f"reference-end-{rank()}.pt")
    strategy.barrier()
    if rank() == 0:
        stage_file.write_text("3")


def main() -> None:
    root, names = Path(sys.argv[1]), sys.argv[2].split(",")
    for name in names:
        run(name, root / name)


if __name__ == "__main__":
    main()
