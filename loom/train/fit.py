"""``loom.fit`` and ``loom.evaluate``: the loop, so research code keeps only model and loss.

Batches are ``(inputs, targets)`` pairs; ``loss_fn(model(inputs), targets)`` must average
over the batch (the default of torch's losses).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

import torch
from torch import nn

from loom.data import DistributedLoader
from loom.strategies import Strategy, auto_strategy
from loom.strategies.base import OptimizerFactory
from loom.train.callbacks import Callback, FitState, ProgressBar, TensorBoard
from loom.train.metrics import Metric, resolve_metrics

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Metrics = Union[None, Sequence[Union[str, Metric]], Mapping[str, Metric]]


def _epoch_logs(strategy: Strategy, sums: torch.Tensor, names: list[str], prefix: str = "") -> dict[str, float]:
    """Sums of [loss, metric..., count] on this replica -> means over all replicas (one all-reduce)."""
    total = strategy.reduce(sums, "sum")
    count = max(float(total[-1]), 1.0)
    return {prefix + name: float(value) / count for name, value in zip(names, total[:-1])}


def _score(outputs: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor, metrics: dict[str, Metric], n: int) -> torch.Tensor:
    """[loss * n, sum of each metric, n] for the first ``n`` samples, as one float64 tensor."""
    values = [loss.detach().double() * n]
    values += [fn(outputs[:n].detach(), targets[:n]).double().sum() for fn in metrics.values()]
    values.append(torch.tensor(float(n), dtype=torch.float64, device=loss.device))
    return torch.stack(values)


@torch.no_grad()
def _evaluate_loader(model: nn.Module, loss_fn: LossFn, loader: DistributedLoader, metrics: dict[str, Metric]) -> torch.Tensor:
    was_training = model.training
    model.eval()
    sums = torch.zeros(len(metrics) + 2, dtype=torch.float64, device=loader.device)
    for k, (inputs, targets) in enumerate(loader):
        outputs = model(inputs)
        n = loader.valid_count(k)  # padding of an uneven last batch is left out
        if n:
            sums += _score(outputs, targets, loss_fn(outputs[:n], targets[:n]), metrics, n)
    model.train(was_training)
    return sums


def evaluate(
    model: nn.Module,
    loss_fn: LossFn,
    data: Any,
    *,
    batch_size: int,
    strategy: Strategy | None = None,
    metrics: Metrics = None,
) -> dict[str, float]:
    """Loss and metrics of ``model`` over all of ``data``, each sample counted once across replicas.

    ``model`` is one returned by ``strategy.prepare``, or a plain module run as it is on
    ``strategy.device`` (its replicas must hold the same weights).
    """
    strategy = strategy or auto_strategy()
    metrics_ = resolve_metrics(metrics)
    model = model.to(strategy.device)
    loader = strategy.distribute(data, batch_size, shuffle=False)
    sums = _evaluate_loader(model, loss_fn, loader, metrics_)
    return _epoch_logs(strategy, sums, ["loss", *metrics_])


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
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int | None = None,
) -> dict[str, list[float]]:
    """Train ``model`` for ``epochs`` under ``strategy`` (default: what the launch implies).

    ``batch_size`` is the global batch. With ``log_dir`` the chief writes TensorBoard scalars
    there. Returns the history: each epoch's logs (``loss``, metrics, ``val_*``, samples/s),
    reduced over all replicas, which is also what callbacks receive.
    """
    strategy = strategy or auto_strategy()
    metrics_ = resolve_metrics(metrics)
    prepared, opt = strategy.prepare(model, optimizer)
    train = strategy.distribute(train_data, batch_size, shuffle=shuffle, seed=seed, num_workers=num_workers)
    val = strategy.distribute(val_data, train.global_batch, shuffle=False) if val_data is not None else None
    hooks: list[Callback] = ([ProgressBar()] if progress else []) + ([TensorBoard(log_dir)] if log_dir else []) + list(callbacks)
    steps = len(train) if train.plan is not None else None
    state = FitState(strategy, prepared, opt, epochs, steps, train.global_batch)
    for cb in hooks:
        cb.on_train_begin(state)
    for epoch in range(epochs):
        state.epoch = epoch
        train.set_epoch(epoch)
        for cb in hooks:
            cb.on_epoch_begin(state)
        sums = torch.zeros(len(metrics_) + 2, dtype=torch.float64, device=strategy.device)
        prepared.train()
        start = time.perf_counter()
        for inputs, targets in train:
            outputs = prepared(inputs)
            loss = loss_fn(outputs, targets)
            strategy.backward(loss)
            opt.step()
            opt.zero_grad()
            sums += _score(outputs, targets, loss, metrics_, len(targets))
            state.step += 1
            for cb in hooks:
                cb.on_batch_end(state, loss)
        elapsed = time.perf_counter() - start
        logs = _epoch_logs(strategy, sums, ["loss", *metrics_])
        if val is not None:
            logs.update(_epoch_logs(strategy, _evaluate_loader(prepared, loss_fn, val, metrics_), ["loss", *metrics_], "val_"))
        logs["samples_per_sec"] = strategy.reduce(sums[-1].item(), "sum") / max(strategy.reduce(elapsed, "max"), 1e-9)
        for key, value in logs.items():
            state.history.setdefault(key, []).append(value)
        for cb in hooks:
            cb.on_epoch_end(state, logs)
        if state.stop:
            break
    for cb in hooks:
        cb.on_train_end(state)
    return state.history
