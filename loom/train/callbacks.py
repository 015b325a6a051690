"""Callbacks: the engineering around the loop (progress, TensorBoard, early stop, Keras' callbacks)."""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from loom.strategies import Strategy


@dataclass
class FitState:
    """What callbacks may read, and ``stop`` which they may set."""

    strategy: Strategy
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None  # None under ``evaluate``
    epochs: int
    steps_per_epoch: int | None
    global_batch: int
    loader: Any = None  # the training data as this replica reads it
    scheduler: Any = None  # the LR scheduler fit steps, if any (saved with the checkpoints)
    validates: bool = False  # whether fit has validation data (some epochs may skip it: validation_freq)
    epoch: int = 0
    step: int = 0
    stop: bool = False
    history: dict[str, list[float]] = field(default_factory=dict)


class Callback:
    """Override the hooks you need. ``logs`` are already reduced over all replicas.

    The ``on_test_*`` hooks run around validation in ``fit`` and around ``evaluate``;
    ``batch`` counts that pass's batches from 0.
    """

    def on_train_begin(self, state: FitState) -> None: ...
    def on_epoch_begin(self, state: FitState) -> None: ...
    def on_batch_begin(self, state: FitState) -> None: ...
    def on_batch_end(self, state: FitState, loss: torch.Tensor) -> None: ...
    def on_epoch_end(self, state: FitState, logs: dict[str, float]) -> None: ...
    def on_train_end(self, state: FitState) -> None: ...
    def on_test_begin(self, state: FitState) -> None: ...
    def on_test_batch_begin(self, state: FitState, batch: int) -> None: ...
    def on_test_batch_end(self, state: FitState, batch: int) -> None: ...
    def on_test_end(self, state: FitState, logs: dict[str, float]) -> None: ...


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


class _Monitor:
    """Keras' ``monitor``/``mode``/``min_delta``: whether an epoch's value improves on the best so far.

    ``mode="auto"`` maximises accuracies, AUC, precision, recall and F1, and minimises the rest.
    """

    MAXIMISED = ("acc", "auc", "auroc", "precision", "recall", "f1")

    def __init__(self, owner: str, monitor: str, mode: str, min_delta: float = 0.0) -> None:
        if mode not in ("min", "max", "auto"):
            raise ValueError(f"mode must be 'min', 'max' or 'auto', got {mode!r}")
        if mode == "auto":
            mode = "max" if any(word in monitor.lower() for word in self.MAXIMISED) else "min"
        self.owner, self.monitor, self.mode, self.min_delta = owner, monitor, mode, abs(min_delta)
        self.best = math.inf if mode == "min" else -math.inf

    def value(self, state: FitState, logs: dict[str, float]) -> float | None:
        """The monitored value; None on an epoch that skipped validation (``validation_freq``)."""
        if self.monitor in logs:
            return logs[self.monitor]
        if state.validates and self.monitor.startswith("val_") and not any(key.startswith("val_") for key in logs):
            return None
        raise KeyError(f"{self.owner} monitors {self.monitor!r}, but the logs hold only {', '.join(logs)}")

    def improves(self, value: float) -> bool:
        """Whether ``value`` beats the best by more than ``min_delta`` (and if so, it is the new best)."""
        better = value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        if better:
            self.best = value
        return better


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` epochs.

    Logs are identical on every replica, so all replicas stop at the same epoch.
    """

    def __init__(self, monitor: str = "val_loss", patience: int = 3, min_delta: float = 0.0, mode: str = "min") -> None:
        self.monitor = _Monitor("EarlyStopping", monitor, mode, min_delta)
        self.patience = patience
        self.waited = 0

    def on_epoch_end(self, state: FitState, logs: dict[str, float]) -> None:
        value = self.monitor.value(state, logs)
        if value is None:
            return
        if self.monitor.improves(value):
            self.waited = 0
            return
        self.waited += 1
        state.stop = self.waited >= self.patience


class ModelCheckpoint(Callback):
    """Keras' ModelCheckpoint: save the model and optimizer to ``directory`` after each epoch.

    With ``save_best_only`` only an epoch whose ``monitor`` improves is saved, and the newest
    checkpoint in ``directory`` is the best one. Checkpoints are loom's (``strategy.save``,
    one ``step-N`` folder each, the last ``keep`` kept): ``strategy.restore(directory,
    model=...)`` loads them under any strategy, and ``fit(checkpoint_dir=directory)`` resumes.
    """

    def __init__(self, directory: str | Path, monitor: str = "val_loss", save_best_only: bool = False, mode: str = "auto", keep: int = 3) -> None:
        self.directory = Path(directory)
        self.monitor = _Monitor("ModelCheckpoint", monitor, mode)
        self.save_best_only = save_best_only
        self.keep = keep

    def on_epoch_end(self, state: FitState, logs: dict[str, float]) -> None:
        if self.save_best_only:
            value = self.monitor.value(state, logs)
            if value is None or not self.monitor.improves(value):
                return
        saved = {"scheduler": state.scheduler} if state.scheduler is not None else {}
        state.strategy.save(self.directory, step=state.step, keep=self.keep, model=state.model, optimizer=state.optimizer,
                            loader=state.loader, epoch=state.epoch + 1, history=state.history, **saved)  # fmt: skip


class CSVLogger(Callback):
    """Keras' CSVLogger: one row per epoch (``epoch`` and every log), written by the chief.

    The file is rewritten whole each epoch, so a column that appears later (validation every
    few epochs) gets a header and ``NA`` where it was missing; ``append`` keeps an earlier run's rows.
    """

    def __init__(self, filename: str | Path, separator: str = ",", append: bool = False) -> None:
        self.path, self.separator, self.append = Path(filename), separator, append
        self.rows: list[dict[str, Any]] = []

    def on_train_begin(self, state: FitState) -> None:
        if self.append and self.path.exists():
            with self.path.open(newline="") as f:
                self.rows = list(csv.DictReader(f, delimiter=self.separator))

    def on_epoch_end(self, state: FitState, logs: dict[str, float]) -> None:
        self.rows.append({"epoch": state.epoch, **logs})
        if not state.strategy.is_chief:
            return
        columns = list(dict.fromkeys(key for row in self.rows for key in row))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, columns, restval="NA", delimiter=self.separator)
            writer.writeheader()
            writer.writerows(self.rows)


def _refuse_two_schedules(state: FitState, callback: str) -> None:
    if state.scheduler is not None:
        raise ValueError(f"{callback} sets the learning rate each epoch, and fit's scheduler= each update: pass one of them")


class LearningRateScheduler(Callback):
    """Keras' LearningRateScheduler: before each epoch, every parameter group's ``lr = schedule(epoch, lr)``.

    ``epoch`` counts from 0, as in Keras. It cannot be combined with fit's per-update ``scheduler=``.
    """

    def __init__(self, schedule: Callable[[int, float], float]) -> None:
        self.schedule = schedule

    def on_train_begin(self, state: FitState) -> None:
        _refuse_two_schedules(state, "LearningRateScheduler")

    def on_epoch_begin(self, state: FitState) -> None:
        for group in state.optimizer.param_groups:  # type: ignore[union-attr]
            group["lr"] = float(self.schedule(state.epoch, group["lr"]))


class ReduceLROnPlateau(Callback):
    """Keras' ReduceLROnPlateau, stepping torch's with the monitored epoch log.

    Keras' meaning of each argument: the LR is multiplied by ``factor`` once ``monitor`` has
    not improved by ``min_delta`` (absolute) for ``patience`` epochs (torch counts one more),
    then waits ``cooldown`` epochs; never below ``min_lr``. Epochs without validation are skipped.
    """

    def __init__(self, monitor: str = "val_loss", factor: float = 0.1, patience: int = 10, mode: str = "auto",
                 min_delta: float = 1e-4, cooldown: int = 0, min_lr: float = 0.0) -> None:  # fmt: skip
        if not 0 < factor < 1:
            raise ValueError(f"ReduceLROnPlateau's factor must be between 0 and 1, got {factor}")
        self.monitor = _Monitor("ReduceLROnPlateau", monitor, mode, min_delta)
        self.settings = {"factor": factor, "patience": max(patience - 1, 0), "threshold": abs(min_delta),
                         "threshold_mode": "abs", "cooldown": cooldown, "min_lr": min_lr}  # fmt: skip
        self._torch: torch.optim.lr_scheduler.ReduceLROnPlateau | None = None

    def on_train_begin(self, state: FitState) -> None:
        _refuse_two_schedules(state, "ReduceLROnPlateau")
        self._torch = torch.optim.lr_scheduler.ReduceLROnPlateau(state.optimizer, mode=self.monitor.mode, **self.settings)  # type: ignore[arg-type]

    def on_epoch_end(self, state: FitState, logs: dict[str, float]) -> None:
        value = self.monitor.value(state, logs)
        if value is not None and self._torch is not None:
            self._torch.step(value)
