"""The strategy-owned training step: one call per global batch, one optimizer update.

A strategy that can run the eager loop (``backward``, then ``optimizer.step()``) runs this
step from the same pieces, so both give the same parameters. Strategies whose step cannot be
eager (a pipeline schedule, one compiled XLA program) replace ``Strategy.train_step`` and keep
its signature and meaning:

- the batch is this replica's share of the global batch; with ``accumulate=k`` it is run as k
  micro-batches whose gradients are summed locally and synchronised once, after the last
  (``loss_fn`` must average over its batch, as torch's losses do by default);
- ``loss_fn=None`` means the model computes its own loss: the step calls ``model(inputs,
  targets)`` (``model(inputs)`` when ``targets`` is None, ``model(**inputs)`` for a dict of
  inputs, labels included, as Hugging Face's models take them) and reads the loss from what
  it returns (``outputs.model_loss``: a scalar tensor, a tuple's one scalar tensor such as
  nanoGPT's ``(logits, loss)``, or a dict's or object's ``loss``);
- with a ``loss_fn``, ``targets`` may be None for a loss that needs none (``loss_fn(outputs, None)``);
- fp16 losses are scaled, and the gradients unscaled once, before clipping;
- ``max_grad_norm`` clips the norm of the gradients after they are synchronised;
- the scheduler steps once per update, never per micro-batch, and not after a step the strategy
  did not apply (a fault-tolerant step refused because a replica group died in it);
- the loss comes back detached and on the device: reading it is the caller's device sync.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from loom.strategies.optimizer import StrategyOptimizer, inner_optimizer
from loom.strategies.outputs import call_with_targets, map_outputs, model_loss

if TYPE_CHECKING:
    from loom.strategies.base import Strategy

LossFn = Optional[Callable[[Any, Any], torch.Tensor]]  # None: the model computes its own loss


class TrainStep:
    """``loss = step(inputs, targets)``: forward, loss, backward, sync, unscale, clip, update, schedule, zero_grad."""

    def __init__(
        self,
        strategy: Strategy,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        accumulate: int = 1,
    ) -> None:
        if not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"train_step(accumulate=...) takes a positive number of micro-batches, got {accumulate!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
        if max_grad_norm is not None:  # a strategy that cannot clip says so now, not after the first backward
            strategy._clip_grad_norm([], max_grad_norm)
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be a function (outputs, targets) -> loss, or None for a model that computes its own, not {type(loss_fn).__name__}")
        if scheduler is not None and not hasattr(scheduler, "step"):
            raise TypeError(f"scheduler must be an LR scheduler (with .step()), not {type(scheduler).__name__}")
        self.strategy = strategy
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.accumulate = accumulate
        self.outputs: Any = None  # the last batch's outputs, detached (for metrics)
        self.grad_norm: torch.Tensor | None = None  # the last update's norm before clipping

    def __call__(self, inputs: Any, targets: Any) -> torch.Tensor:
        strategy = self.strategy
        if strategy._accumulation_steps != 1:
            raise RuntimeError(
                "train_step runs its own accumulation: pass accumulate=k to train_step() instead of "
                "calling it inside strategy.accumulate()"
            )
        size = batch_len(inputs if targets is None else targets)
        chunks = _micro_batches(inputs, targets, min(self.accumulate, size), size)  # a short last batch: fewer
        loss_sum: torch.Tensor | None = None
        outputs = []
        recorder = strategy.step_recorder
        recorder.in_train_step = True
        for i, (x, y) in enumerate(chunks):
            last = i == len(chunks) - 1
            weight = batch_len(x) / size  # the chunks' mean losses add up to the batch mean
            recorder.forward_begins(round(size * weight))
            with strategy._guard(), (nullcontext() if last else strategy._skip_gradient_sync()):
                out, loss = self._forward(x, y)
                strategy.precision.scale(loss * weight).backward()
            recorder.backward_done()
            outputs.append(_detached(out))
            part = loss.detach() * weight
            loss_sum = part if loss_sum is None else loss_sum + part
        self._update()
        recorder.in_train_step = False
        recorder.step_done()
        self.outputs = outputs[0] if len(outputs) == 1 else _concat(outputs)
        assert loss_sum is not None
        return loss_sum

    def _forward(self, inputs: Any, targets: Any) -> tuple[Any, torch.Tensor]:
        """One micro-batch's outputs and mean loss."""
        if self.loss_fn is None:
            out = call_with_targets(self.model, inputs, targets)
            return out, model_loss(out)
        out = self.model(inputs)
        return out, self.loss_fn(out, targets)

    def _update(self) -> None:
        if self.max_grad_norm is not None:  # the eager loop's clipping: unscale once, clip after the sync
            self.grad_norm = self.strategy.clip_gradients(self.optimizer, self.max_grad_norm)
        if isinstance(self.optimizer, StrategyOptimizer):
            self.optimizer.step()  # through the precision's scaler
        else:  # one the user built: the scaler must still unscale it (fp16 losses were scaled)
            self.strategy.precision.step(self.optimizer)
        if self.scheduler is not None and self.strategy._update_applied():
            self.scheduler.step()
        inner_optimizer(self.optimizer).zero_grad(set_to_none=True)


def batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its (first) tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, (list, tuple)) and batch:
        return batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_len(next(iter(batch.values())))
    raise TypeError(f"train_step needs a batch dimension: a tensor, or a list/tuple/dict of them, not {type(batch).__name__}")


def _micro_batches(inputs: Any, targets: Any, k: int, size: int) -> list[tuple[Any, Any]]:
    if k == 1:
        return [(inputs, targets)]
    if size < k:
        raise ValueError(f"train_step(accumulate={k}) cannot split this replica's batch of {size} into {k} micro-batches; use a global batch of at least {k} per replica")
    bounds = [round(size * i / k) for i in range(k + 1)]
    return [(slice_batch(inputs, a, b), slice_batch(targets, a, b)) for a, b in zip(bounds, bounds[1:])]


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of a batch: a tensor, or a list, tuple, dict or dataclass of them.

    A tensor without a batch dimension (a loss the model returned) is kept whole.
    """
    return map_outputs(lambda v: v[start:stop] if isinstance(v, torch.Tensor) and v.dim() > 0 else v, batch)


def _detached(out: Any) -> Any:
    """The outputs without their graph, in containers of the model's own classes."""
    return map_outputs(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, out)


def _concat(parts: list[Any]) -> Any:
    """Micro-batches' outputs as one batch's; a value without a batch dimension is the last one's."""
    return map_outputs(_concat_leaves, parts[0], *parts[1:])


def _concat_leaves(*values: Any) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(values) if first.dim() > 0 else values[-1]
    return first
