"""Callbacks: the engineering around the loop (progress, TensorBoard, early stop)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from loom.strategies import Strategy


@dataclass
class FitState:
    """What callbacks may read, and ``stop`` which they may set."""

    strategy: Strategy
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    epochs: int
    steps_per_epoch: int | None
    global_batch: int
    loader: Any = None  # the training data as this replica reads it
    scheduler: Any = None  # the LR scheduler fit steps, if any (saved with the checkpoints)
    epoch: int = 0
    step: int = 0
    stop: bool = False
    history: dict[str, list[float]] = field(default_factory=dict)


class Callback:
    """Override the hooks you need. ``logs`` are already reduced over all replicas."""

    def on_train_begin(self, state: FitState) -> None: ...
    def on_epoch_begin(self, state: FitState) -> None: ...
    def on_batch_end(self, state: FitState, loss: torch.Tensor) -> None: ...
    def on_epoch_end(self, state: FitState, logs: dict[str, float]) -> None: ...
    def on_train_end(self, state: FitState) -> None: ...


def format_logs(logs: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4g}" if k != "samples_per_sec" else f"{v:,.0f} samples/s" for k, v in logs.items())


class ProgressBar(Callback):
    """A live bar on the chief (loss and samples/s), and one summary line per epoch."""

    def __init__(self, refresh_seconds: float = 0.25) -> None:
        self.refresh_seconds = refresh_seconds
        self.console = Console(stderr=False)
        self._progress: Progress | None = None

    def on_epoch_begin(self, state: FitState) -> None:
        if not state.strategy.is_chief or not self.console.is_terminal:
            return
        self._progress = Progress(
            TextColumn(f"epoch {state.epoch + 1}/{state.epochs}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            transient=True,
        )
        self._task = self._progress.add_task("train", total=state.steps_per_epoch, status="")
        self._progress.start()
        self._start = self._last = time.perf_counter()
        self._steps = 0

    def on_batch_end(self, state: FitState, loss: torch.Tensor) -> None:
        if self._progress is None:
            return
        self._steps += 1
        self._progress.update(self._task, completed=self._steps)  # cheap: rich redraws on its own thread
        now = time.perf_counter()
        if now - self._last >= self.refresh_seconds:  # .item() syncs: only as often as a person can read
            rate = self._steps * state.global_batch / (now - self._start)
            status = f"loss {loss.item():.4f}  {rate:,.0f} samples/s"
            stats = getattr(state.loader, "stats", None)  # a loom.data pipeline times its input
            if stats is not None:
                status += f"  input wait {stats.wait_fraction:.0%}"
            job = state.strategy.job_report()  # parameter servers: the whole job's progress
            if job:
                status += f"  global step {job['global_step']:,.0f}  {job['updates_per_sec']:,.0f} updates/s"
                if "staleness_p50" in job:
                    status += f"  staleness p50 {job['staleness_p50']:.0f} p90 {job['staleness_p90']:.0f}"
            self._progress.update(self._task, status=status)
            self._last = now

    def on_epoch_end(self, state: FitState, logs: dict[str, float]) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if state.strategy.is_chief:
            print(f"epoch {state.epoch + 1}/{state.epochs}  {format_logs(logs)}", flush=True)
            stats = getattr(state.loader, "stats", None)
            if stats is not None and stats.summary()["input_bound"]:
                print(state.loader.report(), flush=True)


class TensorBoard(Callback):
    """Scalars for every epoch log and the running training loss, written by the chief only."""

    def __init__(self, log_dir: str, every_steps: int = 10) -> None:
        self.log_dir = log_dir
        self.every_steps = every_steps
        self._writer: Any = None

    def on_train_begin(self, state: FitState) -> None:
        if state.strategy.is_chief:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where used

            self._writer = SummaryWriter(self.log_dir)

    def on_batch_end(self, state: FitState, loss: torch.Tensor) -> None:
        if self._writer is not None and state.step % self.every_steps == 0:
            self._writer.add_scalar("train/step_loss", loss.item(), state.step)
            for key, value in (state.strategy.job_report() or {}).items():
                self._writer.add_scalar(f"job/{key}", value, state.step)

    def on_epoch_end(self, state: FitState, logs: dict[str, float]) -> None:
        if self._writer is None:
            return
        for key, value in logs.items():
            group = "val" if key.startswith("val_") else "train"
            self._writer.add_scalar(f"{group}/{key.removeprefix('val_')}", value, state.epoch + 1)
        self._writer.flush()

    def on_train_end(self, state: FitState) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    Logs are identical on every replica, so all replicas stop at the same epoch.
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 3, min_delta: float = 0.0, mode: str = "min") -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, min_delta, mode
        self.best = math.inf if mode == "min" else -math.inf
        self.waited = 0

    def on_epoch_end(self, state: FitState, logs: dict[str, float]) -> None:
        if self.monitor not in logs:
            raise KeyError(f"EarlyStopping monitors {self.monitor!r}, but the logs hold only {', '.join(logs)}")
        value = logs[self.monitor]
        better = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        if better:
            self.best, self.waited = value, 0
            return
        self.waited += 1
        state.stop = self.waited >= self.patience
