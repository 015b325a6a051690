"""Keras' BackupAndRestore for ``loom.fit``: a job that is killed or preempted picks up where it was.

At start, fit restores the newest complete checkpoint (model, optimizer, input position,
epoch, history, every replica's RNG), or, when that one is damaged, the newest before it
that is whole (saying so). It saves every ``every`` steps and at each epoch's end; a step
that ends an epoch is saved once, by the epoch's save, which holds its logs (when the data
has no length, that save replaces the step's, safely: ``layout.commit``). While fit trains,
SIGTERM makes every replica save after the same step and exit 0; with ``loom run
--max-restarts N`` a job that lost a process is restarted and resumes here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loom.strategies import Strategy
from loom.train.callbacks import FitState


class BackupAndRestore:
    def __init__(self, strategy: Strategy, directory: str | Path, every: int | None, keep: int, async_save: bool) -> None:
        self.strategy = strategy
        self.directory = Path(directory)
        self.every = every
        self.keep = keep
        self.async_save = async_save

    def restore(self, state: FitState, loader: Any) -> int:
        """The epoch to start from: the saved one, with the model, optimizer and loader restored."""
        saved = self.strategy.restore(self.directory, fallback=True, model=state.model, optimizer=state.optimizer, loader=loader, **_scheduler(state))
        if saved is None:
            return 0
        state.step, state.history = saved["step"], saved["history"]
        if self.strategy.is_chief:
            print(f"loom: resumed from {saved['path']} (step {saved['step']}, epoch {saved['epoch'] + 1})", flush=True)
        return saved["epoch"]

    def after_step(self, state: FitState, loader: Any) -> None:
        preempted = self.strategy.preempted()
        ends_epoch = bool(state.steps_per_epoch) and state.step % state.steps_per_epoch == 0
        if preempted or (self.every and state.step % self.every == 0 and not ends_epoch):
            self._save(state, loader, state.epoch)
        if preempted:
            self._exit(f"loom: preempted: saved step {state.step} to {self.directory}; exiting")

    def _exit(self, line: str) -> None:
        self.strategy.shutdown()  # waits for an asynchronous save to be committed
        if self.strategy.is_chief:
            print(line, flush=True)
        raise SystemExit(0)

    def after_epoch(self, state: FitState, loader: Any) -> None:
        self._save(state, loader, state.epoch + 1)

    def at_end(self) -> None:
        """The end of fit is a step boundary too: a SIGTERM since the last step's check exits 0 once
        the last save is committed, on every replica alike."""
        if self.strategy.preempted():
            self._exit(f"loom: preempted at the end of training; its last checkpoint is in {self.directory}; exiting")

    def _save(self, state: FitState, loader: Any, epoch: int) -> None:
        self.strategy.save(
            self.directory, step=state.step, keep=self.keep, async_save=self.async_save,
            model=state.model, optimizer=state.optimizer, loader=loader, epoch=epoch, history=state.history, **_scheduler(state),
        )  # fmt: skip


def _scheduler(state: FitState) -> dict[str, Any]:
    return {"scheduler": state.scheduler} if state.scheduler is not None else {}
