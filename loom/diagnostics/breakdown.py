"""Where each step's time goes on this rank: input wait, compute, unhidden communication, optimizer, the rest.

The strategy owns one ``StepRecorder``; ``prepare`` hooks it to the model and the optimizer,
so ``fit``, ``train_step`` and the eager loop are all recorded without a change to the loop.
Marks are host clock readings taken at points the step passes anyway:

- the model's forward pre-hook starts compute; the time since the previous step ended (or,
  in ``fit``, since it asked for the next batch) is input wait;
- each parameter's post-accumulate-grad hook moves "last gradient ready"; after the last one
  the backward pass has nothing left to compute and only waits for the gradient reduction
  (DDP's last bucket), so from there to the end of ``backward`` is communication that was
  not hidden behind compute;
- the optimizer's step pre- and post-hooks time the update;
- the step ends with the optimizer (eager loop) or when ``train_step`` returns; whatever is
  left (clipping, the scheduler, the loop's own code) is "other".

Only sums are kept (constant memory); the first step after each reset is start-up and is
left out. The marks are host times: on an accelerator, whose kernels run after the host has
moved on, they do not say where the device's time goes, and the report gives no verdict there.
"""

from __future__ import annotations

import socket
import time
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch import nn

PARTS = ("input", "compute", "comm", "optimizer", "other")


class StepRecorder:
    """Per-step time of one rank, split into ``PARTS``; sums since the last ``reset``."""

    def __init__(self, owner: Any = None) -> None:
        from loom.diagnostics.scale import steps_limit

        self.owner = owner  # the strategy: under ``loom scale`` it reports and ends the run
        self.limit = steps_limit()
        self.counted = 0  # steps counted since the start, for the limit
        self.grad_bytes = 0  # gradients this rank's model produces per step (what an all-reduce moves)
        self.embedding_bytes = 0  # ... of which embedding tables
        self.host = socket.gethostname()
        self._hooked: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._optimizer_hooked = False
        self.in_train_step = False  # train_step ends its own step (after the scheduler and zero_grad)
        self.verdict_kind: str | None = None  # the last report's verdict, which holds within noise
        self.reset()

    def reset(self) -> None:
        """Start a new window; its first step (start-up) is not counted."""
        self.sums = dict.fromkeys(PARTS, 0.0)
        self.steps = 0
        self.samples = 0
        self._step_start: float | None = None
        self._mark = 0.0  # when input waiting began (the last step's end, or fit asking for a batch)
        self._forward: float | None = None  # the current micro-batch's forward start, while computing
        self._grad = 0.0
        self._optimizer: float | None = None
        self._current = dict.fromkeys(PARTS, 0.0)
        self._samples = 0
        self._started = False  # the window's first step has ended

    # ---- wiring ------------------------------------------------------------------------------
    def watch(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Hook ``model`` (forward start, gradients ready) and the first optimizer prepared."""
        if model not in self._hooked:
            self._hooked.add(model)
            model.register_forward_pre_hook(self._forward_hook)
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._grad_hook)
                    self.grad_bytes += p.numel() * p.element_size()
            tables = [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
            self.embedding_bytes += sum(w.numel() * w.element_size() for w in tables if w.requires_grad)
        if optimizer is not None and not self._optimizer_hooked:
            self._optimizer_hooked = True
            optimizer.register_step_pre_hook(self._optimizer_pre_hook)
            optimizer.register_step_post_hook(self._optimizer_post_hook)

    def _forward_hook(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():  # evaluation passes are not steps
            self.forward_begins(batch_size_of(args[0]) if args else 0)

    def _grad_hook(self, param: torch.Tensor) -> None:
        self._grad = time.perf_counter()

    def _optimizer_pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_begins()

    def _optimizer_post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.optimizer_done()

    # ---- marks -------------------------------------------------------------------------------
    def input_begins(self) -> None:
        """The loop asks for its next batch: time from here to the forward is input wait."""
        if self._forward is None:
            self._mark = time.perf_counter()

    def forward_begins(self, samples: int = 0) -> None:
        """A micro-batch of ``samples`` starts its forward pass (later calls in it are ignored)."""
        if self._forward is not None:
            return
        now = time.perf_counter()
        if self._step_start is None:
            self._step_start = self._mark = now
        self._current["input"] += now - self._mark
        self._forward = now
        self._grad = 0.0
        self._samples += samples

    def backward_done(self) -> None:
        """End of one micro-batch's backward, its gradients reduced."""
        if self._forward is None:
            return
        now = time.perf_counter()
        computed = self._grad if self._grad > self._forward else now
        self._current["compute"] += computed - self._forward
        self._current["comm"] += now - computed
        self._forward = None
        self._mark = now

    def optimizer_begins(self) -> None:
        if self._optimizer is None:
            self._optimizer = time.perf_counter()

    def optimizer_done(self) -> None:
        if self._optimizer is None:
            return
        self._current["optimizer"] += time.perf_counter() - self._optimizer
        self._optimizer = None
        if not self.in_train_step:
            self.step_done()

    def step_done(self) -> None:
        """One update finished: add the step to the sums (unless it is the window's first)."""
        now = time.perf_counter()
        self._forward = None
        if self._step_start is not None:
            current = self._current
            current["other"] = max(now - self._step_start - sum(current[p] for p in PARTS if p != "other"), 0.0)
            if self._started:
                for part in PARTS:
                    self.sums[part] += current[part]
                self.steps += 1
                self.counted += 1
                self.samples += self._samples
            self._started = True
        self._samples = 0
        self._current = dict.fromkeys(PARTS, 0.0)
        self._step_start = self._mark = now
        if self.limit is not None and self.counted >= self.limit and self.owner is not None:
            from loom.diagnostics.scale import finish

            finish(self.owner)

    # ---- results -----------------------------------------------------------------------------
    def means(self) -> dict[str, float]:
        """Seconds per step of each part, and ``total``."""
        n = max(self.steps, 1)
        means = {part: self.sums[part] / n for part in PARTS}
        means["total"] = sum(means.values())
        return means


def batch_size_of(batch: Any) -> int:
    """Samples in a forward's first argument; 0 where it has no batch dimension."""
    while isinstance(batch, (list, tuple, dict)) and batch:
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return batch.shape[0] if isinstance(batch, torch.Tensor) and batch.dim() else 0


def timed_batches(recorder: StepRecorder, batches: Iterable[Any]) -> Iterator[Any]:
    """``batches``, marking when the loop starts waiting for each (``fit``'s exact input wait)."""
    iterator = iter(batches)
    while True:
        recorder.input_begins()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        yield batch
