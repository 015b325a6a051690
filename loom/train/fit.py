"""``loom.fit`` and ``loom.evaluate``: the loop, so research code keeps only model and loss.

Batches are ``(inputs, targets)`` pairs; ``loss_fn(model(inputs), targets)`` must average
over the batch (the default of torch's losses). ``loss_fn=None`` is for a model that computes
its own loss from ``model(inputs, targets)`` (the rules are ``train_step``'s).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import Any, Callable, Container, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import DataLoader

from loom.comm import preemption
from loom.data import DistributedLoader
from loom.diagnostics.breakdown import timed_batches
from loom.diagnostics.report import mention_advice, report
from loom.strategies import Strategy, auto_strategy, unwrap
from loom.strategies.base import OptimizerFactory
from loom.strategies.outputs import call_with_targets, model_loss
from loom.strategies.step import batch_len, slice_batch
from loom.train.backup import BackupAndRestore
from loom.train.callbacks import Callback, FitState, ProgressBar, TensorBoard
from loom.train.metrics import SyncedMetric, is_stateful, resolve_metrics

LossFn = Optional[Callable[[Any, Any], torch.Tensor]]  # None: the model computes its own loss
Metrics = Union[None, Sequence[Any], Mapping[str, Any]]  # names, functions, torchmetrics.Metric instances


class _Totals:
    """Per-replica sums of [loss * n, each per-sample metric] on the device, the sample count on the host,
    and a ``SyncedMetric`` for each torchmetrics metric.

    Kept apart so a step adds no host-to-device copy; ``reduce`` combines the sums over the
    replicas in one all-reduce, and each torchmetrics metric syncs its own states.
    """

    def __init__(self, metrics: dict[str, Any], strategy: Strategy, device: torch.device) -> None:
        self.summed = {name: fn for name, fn in metrics.items() if not is_stateful(fn)}
        self.synced = {name: SyncedMetric(m, strategy) for name, m in metrics.items() if is_stateful(m)}
        self.names = ["loss", *self.summed]
        self.sums = torch.zeros(len(self.names), dtype=torch.float64, device=device)
        self.count = 0

    def add(self, outputs: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor, n: int) -> None:
        """Score the first ``n`` samples of a batch whose mean loss is ``loss``."""
        scores = [loss.detach().double() * n]
        outputs, targets = slice_batch(outputs, 0, n), slice_batch(targets, 0, n)
        scores += [fn(outputs, targets).double().sum() for fn in self.summed.values()]
        self.sums += torch.stack(scores)
        self.count += n
        for metric in self.synced.values():
            metric.update(outputs, targets)

    def reduce(self, strategy: Strategy, prefix: str = "") -> tuple[dict[str, float], int]:
        """Means over every sample of every replica, and how many samples that was."""
        total = strategy.reduce(torch.cat([self.sums, self.sums.new_tensor([self.count])]), "sum")
        count = int(total[-1])
        logs = {prefix + name: float(value) / max(count, 1) for name, value in zip(self.names, total[:-1])}
        return logs | {prefix + name: metric.compute() for name, metric in self.synced.items()}, count


def _in_order(data: Any) -> bool | None:
    """Evaluation reads a data set in order; a DataLoader keeps the sampler its author chose."""
    return None if isinstance(data, DataLoader) else False


def _batches(loader: DistributedLoader, steps: int | None = None) -> Iterator[tuple[Any, Any, int]]:
    """``(inputs, targets, real samples here)`` of each batch; with ``steps``, only the first ``steps``."""
    for k, (inputs, targets) in enumerate(itertools.islice(loader, steps)):
        yield inputs, targets, loader.valid_count(k)


def _repeated(loader: DistributedLoader) -> Iterator[tuple[Any, Any, int]]:
    """The loader's batches pass after pass (each pass reshuffled): ``steps_per_epoch`` epochs cut this stream.

    A pass resumed at its very end is empty; two empty passes in a row mean the data is.
    """
    empty_passes = 0
    while empty_passes < 2:
        empty_passes += 1
        for batch in _batches(loader):
            empty_passes = 0
            yield batch
    raise ValueError("the training data has no batches: steps_per_epoch needs data to repeat")


@torch.no_grad()
def _evaluate_loader(
    model: nn.Module, loss_fn: LossFn, loader: DistributedLoader, metrics: dict[str, Any],
    state: FitState, hooks: Sequence[Callback] = (), steps: int | None = None, prefix: str = "",
) -> dict[str, float]:  # fmt: skip
    """The reduced logs of one pass (the first ``steps`` batches from the start), with the ``on_test_*`` hooks."""
    was_training = model.training
    model.eval()
    for cb in hooks:
        cb.on_test_begin(state)
    totals = _Totals(metrics, state.strategy, loader.device)
    for k, (inputs, targets, n) in enumerate(_batches(loader, steps)):  # padding of an uneven last batch is left out
        for cb in hooks:
            cb.on_test_batch_begin(state, k)
        if loss_fn is None:  # the model's loss covers what it is given: the real samples (every replica runs a forward)
            real = n or batch_len(inputs)
            outputs = call_with_targets(model, slice_batch(inputs, 0, real), slice_batch(targets, 0, real))
            loss = model_loss(outputs)
        else:
            outputs = model(inputs)
            loss = loss_fn(slice_batch(outputs, 0, n), slice_batch(targets, 0, n)) if n else None
        if n:
            totals.add(outputs, targets, loss, n)
        for cb in hooks:
            cb.on_test_batch_end(state, k)
    model.train(was_training)
    logs = totals.reduce(state.strategy, prefix)[0]
    for cb in hooks:
        cb.on_test_end(state, logs)
    return logs


def evaluate(
    model: nn.Module,
    loss_fn: LossFn,
    data: Any,
    *,
    batch_size: int,
    strategy: Strategy | None = None,
    metrics: Metrics = None,
    steps: int | None = None,
    callbacks: Iterable[Callback] = (),
) -> dict[str, float]:
    """Loss and metrics of ``model`` over all of ``data``, each sample counted once across replicas.

    ``model`` is one returned by ``strategy.prepare``, or a plain module run as it is on
    ``strategy.device`` (its replicas must hold the same weights). ``steps`` evaluates only the
    first ``steps`` global batches; ``callbacks`` receive the ``on_test_*`` hooks.
    """
    strategy = strategy or auto_strategy()
    metrics_ = resolve_metrics(metrics)
    if not any(p.is_meta for p in model.parameters()):  # a pipeline stage holds only its own layers
        model = model.to(strategy.device)
    loader = strategy.distribute(data, batch_size, shuffle=_in_order(data))
    state = FitState(strategy, model, None, 0, loader.steps_per_epoch, loader.global_batch, loader)
    return _evaluate_loader(model, loss_fn, loader, metrics_, state, list(callbacks), steps)


def _validates(epoch: int, freq: int | Container[int]) -> bool:
    """Keras' validation_freq: every ``freq`` epochs, or on the (1-based) epochs it lists."""
    return (epoch + 1) % freq == 0 if isinstance(freq, int) else epoch + 1 in freq


def fit(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    train_data: Any,
    *,
    epochs: int = 1,
    batch_size: int | None = None,
    strategy: Strategy | None = None,
    val_data: Any = None,
    metrics: Metrics = None,
    callbacks: Iterable[Callback] = (),
    log_dir: str | None = None,
    progress: bool = True,
    shuffle: bool | None = None,
    seed: int = 0,
    num_workers: int | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int = 3,
    async_checkpoint: bool = False,
    scheduler: Any = None,
    max_grad_norm: float | None = None,
    accumulate: int = 1,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_freq: int | Container[int] = 1,
    initial_epoch: int = 0,
) -> dict[str, list[float]]:
    """Train ``model`` for ``epochs`` under ``strategy`` (default: what the launch implies).

    ``batch_size`` is the global batch. Each batch is one ``strategy.train_step``: ``scheduler``
    (an LR scheduler, or a factory ``lambda opt: StepLR(opt, 10)``) steps once per update,
    ``max_grad_norm`` clips after the gradient sync, ``accumulate=k`` runs every batch as k
    micro-batches. With ``log_dir`` the chief writes TensorBoard scalars there. Returns the
    history: each epoch's logs (``loss``, metrics, ``val_*``, samples/s), reduced over all
    replicas and counting each real sample once (not the padding of an uneven last batch),
    which is also what callbacks receive. The chief prints where every rank's step time went and
    a verdict (``loom.diagnostics``) after the first epoch, after each epoch whose verdict changed,
    and at the end, which also says when ``loom.advise`` recommends another strategy; with
    ``log_dir`` every epoch's breakdown goes to TensorBoard, JSON and a PNG.

    With ``checkpoint_dir`` the run resumes from the newest checkpoint there, saves every
    ``checkpoint_every`` steps and after every epoch, and on SIGTERM while it trains saves and
    exits 0 (``loom.train.backup``). An epoch resumed in the middle logs the mean of its remaining steps.

    ``loss_fn=None`` trains a model that computes its own loss (``model(inputs, targets)``, see
    ``Strategy.train_step``); metrics then receive its whole output. Its logged training loss for
    an uneven last batch is the one it trained on, padding included (``val_loss`` counts only the
    real samples).

    Keras' arguments: ``steps_per_epoch`` cuts epochs of that many steps from the training data
    read pass after pass (each pass reshuffled), as a ``.repeat()``ed dataset is in Keras;
    ``validation_steps`` evaluates the first that many batches of ``val_data`` each time;
    ``validation_freq`` validates every that many epochs, or on the (1-based) epochs listed;
    ``initial_epoch`` starts at that epoch (its data order is that epoch's).
    """
    strategy = strategy or auto_strategy()
    metrics_ = resolve_metrics(metrics)
    prepared, opt = strategy.prepare(model, optimizer)
    if scheduler is not None and (isinstance(scheduler, type) or not hasattr(scheduler, "step")):
        scheduler = scheduler(opt)  # a factory (or a class) taking the optimizer
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "fit steps its scheduler once per update, and ReduceLROnPlateau needs a metric: "
            "pass callbacks=[loom.train.ReduceLROnPlateau(monitor='val_loss')] instead"
        )
    step = strategy.train_step(prepared, loss_fn, opt, scheduler=scheduler, max_grad_norm=max_grad_norm, accumulate=accumulate)
    train = strategy.distribute(train_data, batch_size, shuffle=shuffle, seed=seed, num_workers=num_workers)
    val = None
    if val_data is not None:  # a DataLoader keeps its own batch size
        val_batch = None if isinstance(val_data, DataLoader) else train.global_batch
        val = strategy.distribute(val_data, val_batch, shuffle=_in_order(val_data))
    hooks: list[Callback] = ([ProgressBar()] if progress else []) + ([TensorBoard(log_dir)] if log_dir else []) + list(callbacks)
    state = FitState(strategy, prepared, opt, epochs, steps_per_epoch or train.steps_per_epoch, train.global_batch, train, scheduler=scheduler, validates=val is not None)
    backup = None
    first_epoch = initial_epoch
    if checkpoint_dir is not None:
        backup = BackupAndRestore(strategy, checkpoint_dir, checkpoint_every, keep_checkpoints, async_checkpoint)
        first_epoch = max(initial_epoch, backup.restore(state, train))
    with preemption.armed_while() if backup is not None else contextlib.nullcontext():  # SIGTERM saves only while fit runs
        stream = _repeated(train) if steps_per_epoch is not None else None  # a resumed loader continues where it was
        for cb in hooks:
            cb.on_train_begin(state)
        inputs = None
        for epoch in range(first_epoch, epochs):
            state.epoch = epoch
            if stream is None:
                train.set_epoch(epoch)
                batches = _batches(train)
            else:  # the rest of this epoch's steps (all of them, unless resumed in the middle)
                batches = itertools.islice(stream, steps_per_epoch - state.step % steps_per_epoch)
            for cb in hooks:
                cb.on_epoch_begin(state)
            totals = _Totals(metrics_, strategy, strategy.device)
            prepared.train()
            start = time.perf_counter()
            for inputs, targets, n in timed_batches(strategy.step_recorder, batches):
                for cb in hooks:
                    cb.on_batch_begin(state)
                loss = step(inputs, targets)
                # the padding of an uneven last batch is trained on, not counted
                if n == batch_len(targets) or (n and loss_fn is None):  # a model's own loss: over the batch it trained on
                    totals.add(step.outputs, targets, loss, n)
                elif n:
                    totals.add(step.outputs, targets, loss_fn(slice_batch(step.outputs, 0, n), slice_batch(targets, 0, n)), n)
                state.step += 1
                for cb in hooks:
                    cb.on_batch_end(state, loss)
                if backup is not None:
                    backup.after_step(state, train)
            elapsed = time.perf_counter() - start
            logs, samples = totals.reduce(strategy)
            if val is not None and _validates(epoch, validation_freq):
                logs.update(_evaluate_loader(prepared, loss_fn, val, metrics_, state, hooks, validation_steps, prefix="val_"))
            logs["samples_per_sec"] = samples / max(strategy.reduce(elapsed, "max"), 1e-9)
            for key, value in logs.items():
                state.history.setdefault(key, []).append(value)
            if backup is not None:
                backup.after_epoch(state, train)
            for cb in hooks:
                cb.on_epoch_end(state, logs)
            breakdown = report(strategy, loader=train, log_dir=log_dir, step=epoch + 1, show=False)  # always to log_dir
            last = state.stop or epoch == epochs - 1
            if progress and (breakdown.changed or last):  # the table when the verdict changes, and at the end
                strategy.print(breakdown.table())
            if last:
                if progress:  # when loom.advise recommends another strategy, say so
                    mention_advice(strategy, unwrap(prepared), inputs, breakdown)
                break
        for cb in hooks:
            cb.on_train_end(state)
        if backup is not None:
            backup.at_end()
        return state.history
