"""The Strategy contract: the one object that changes between set-ups.

A training loop written against these methods runs unchanged under every strategy::

    model, opt = strategy.prepare(Net(), lambda params: torch.optim.SGD(params, lr=0.1))
    step = strategy.train_step(model, F.cross_entropy, opt, scheduler=None, max_grad_norm=None)
    for x, y in strategy.distribute(dataset, batch_size=256):   # the global batch
        loss = step(x, y)

The eager loop (``strategy.backward(loss)``, then ``opt.step(); opt.zero_grad()``) gives the
same parameters under every strategy where it is exact; a strategy whose step cannot be eager
(a pipeline, XLA) refuses ``backward`` and points to ``train_step``.
"""

from __future__ import annotations

import os
import sys
import warnings
from abc import ABC, abstractmethod
from contextlib import contextmanager, nullcontext
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from loom import comm
from loom.comm import Connection, preemption, resolve_timeout
from loom.comm.groups import refuse_alone_in_groups
from loom.data import DistributedLoader, Pipeline, PipelineLoader
from loom.fast import exact
from loom.fast.fast_path import PARTS, apply as apply_fast_path, check_candidates as fast_path_candidates, choose as choose_fast_path, refuse as refuse_fast_path
from loom.strategies import cross_replica
from loom.strategies.cross_replica import Number
from loom.strategies.optimizer import StrategyOptimizer, check_owned
from loom.strategies.precision import Precision, canonical
from loom.strategies.step import LossFn, TrainStep
from loom.strategies.tf_compat import TFNames, reduce_arguments
from loom.strategies.wrappers import SCALER_SUFFIX, scaled_optimizers, unwrap, unwrapped_state  # noqa: F401 - unwrap: imported from here too

if TYPE_CHECKING:
    from loom.checkpoint.checkpointer import Checkpointer

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LAYOUT_ENV = "LOOM_JOB_LAYOUT"  # the launcher's "1 node x 2 processes (--nproc 2)": the chief ends the job's first line with it


class Strategy(TFNames, ABC):
    """Where replicas run, how gradients are combined, how data is split between them."""

    trains_across_groups = False  # whether it combines the replica groups of `loom run --groups`

    def __init__(self, precision: str = "32", timeout: float | None = None) -> None:
        refuse_alone_in_groups(type(self).__name__, self.trains_across_groups)
        self.timeout = resolve_timeout(timeout)
        self._precision_name = canonical(precision)
        self._connection: Connection | None = None
        self._accumulation_steps = 1
        self._micro_steps = 0
        self._accumulating: torch.optim.Optimizer | None = None  # the one optimizer an accumulate() cycle steps
        self._optimizers = 0  # prepared: their steps go through the precision
        self._model_in_parts = False  # each process holds part of the model: the exact fast path is the allocator alone

    # ---- topology ---------------------------------------------------------------------------
    @property
    @abstractmethod
    def num_replicas_in_sync(self) -> int:
        """Replicas whose gradients are combined in every step."""

    @property
    @abstractmethod
    def replica_id(self) -> int:
        """This process's replica, 0 .. num_replicas_in_sync - 1."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device this replica computes on; batches from ``distribute`` arrive there."""

    @property
    def is_chief(self) -> bool:
        """The replica that logs, prints and writes files that exist once per job."""
        return self.replica_id == 0

    @property
    def model_parallel_degrees(self) -> dict[str, int]:
        """Processes that one replica spans, by kind (``{"tensor-parallel rank": 2}``); none for data parallelism."""
        return {}

    def _announce(self) -> None:
        """The job's first line, once, from the chief: what the launcher cannot know, the replicas
        and the degrees of model parallelism, then the processes it started."""
        layout = os.environ.get(LAYOUT_ENV)
        if layout is None or (self._connection is None and dist.is_initialized()):  # a part of another strategy
            return
        del os.environ[LAYOUT_ENV]
        parts = [_count(self.num_replicas_in_sync, "replica")] + [_count(d, kind) for kind, d in self.model_parallel_degrees.items()]
        if self.is_chief:
            print(f"loom: {' x '.join(parts)} = {layout}", file=sys.stderr, flush=True)

    @cached_property
    def precision(self) -> Precision:
        """Built on first use: subclasses know their device only after this class's __init__."""
        return Precision(self._precision_name, self.device)

    # ---- model and optimizer ----------------------------------------------------------------
    def _wrap_model(self, module: nn.Module) -> nn.Module:
        """Strategy-specific wrapping (DDP, FSDP, ...); the identity for one device."""
        return module

    @contextmanager
    def _skip_gradient_sync(self) -> Iterator[None]:
        """Context in which backward accumulates locally without communicating."""
        self._set_gradient_sync(False)
        try:
            yield
        finally:
            self._set_gradient_sync(True)

    def prepare(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
        *,
        fast_path: bool | Sequence[str] | None = None,
        example_input: torch.Tensor | None = None,
    ) -> Union[nn.Module, tuple[nn.Module, StrategyOptimizer]]:
        """Place and wrap ``model``; wrap ``optimizer`` (or build it from a factory on the placed params).

        The module passed in stays usable and holds the trained parameters (``loom.unwrap``
        returns it from the wrapped one). Returns ``model`` alone when no optimizer is given.
        On CPU the exact speed-ups (``reuse_memory``, ``pool_before_relu``, ``pool_nhwc``: they change no number)
        are on, said in one line; ``fast_path=False`` turns them off (``loom.fast.exact``).
        ``fast_path=True`` (or a list of candidates) also times the inexact ones (channels_last,
        pool_kernel, torch.compile) against eager on ``example_input`` (one batch of this replica's
        inputs), keeps the fastest within a stated tolerance, and says which in one line
        (``loom.fast.fast_path``).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"prepare() takes an nn.Module, not {type(model).__name__}")
        self._announce()
        candidates = fast_path_candidates(fast_path)
        if candidates and example_input is None:
            raise ValueError(
                "prepare(fast_path=...) measures the model on a batch: pass example_input=<one batch of this "
                "replica's inputs>, e.g. the first x from strategy.distribute(...)"
            )
        module = model.to(self.device)
        with self._guard():
            said = exact.apply(module, fast_path) if self.device.type == "cpu" and not self._model_in_parts else None
            if said:  # beside the job's first line, on stderr: what loom did, not what the script prints
                self.print(said, file=sys.stderr)
            plan = None
            if candidates:
                plan = choose_fast_path(module, example_input.to(self.device), candidates, self.precision.autocast, self.precision.dtype)
                apply_fast_path(module, plan)
                self.print(plan.line())
            inner = self._wrap_model(module)
            if plan is not None and plan.compile:  # around DDP, so its buckets still overlap the backward
                inner = torch.compile(inner)
            wrapped = self.precision.wrap(inner)
        if optimizer is None:
            self.step_recorder.watch(wrapped)
            return wrapped
        if isinstance(optimizer, torch.optim.Optimizer):
            inner = optimizer
            check_owned(inner, module.parameters())
        elif callable(optimizer):
            inner = optimizer(module.parameters())
            if not isinstance(inner, torch.optim.Optimizer):
                raise TypeError(f"the optimizer factory returned {type(inner).__name__}, not a torch.optim.Optimizer")
        else:
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory, not {type(optimizer).__name__}")
        self._optimizers += 1
        self.step_recorder.watch(wrapped, inner)
        return wrapped, StrategyOptimizer(inner, self.precision, self._may_step)

    def train_step(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        accumulate: int = 1,
    ) -> TrainStep:
        """The step this strategy owns: ``loss = step(inputs, targets)`` once per global batch.

        Forward, ``loss_fn(model(inputs), targets)``, backward, gradient sync, fp16 unscaling,
        clipping to ``max_grad_norm`` (after the sync), the optimizer's step, the scheduler's
        (once per update) and ``zero_grad``. ``accumulate=k`` runs each batch as k
        micro-batches with one sync; it equals the whole batch at once. The loss comes back
        detached, without a device sync; ``step.outputs`` holds the batch's outputs.
        ``loss_fn=None`` is for a model that computes its own loss: the step calls
        ``model(inputs, targets)`` and takes the loss from what it returns (the rules are in
        ``loom.strategies.step``).
        """
        return TrainStep(self, model, loss_fn, optimizer, scheduler, max_grad_norm, accumulate)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward(**kwargs)`` with the strategy's gradient sync, scaling and accumulation.

        Once per micro-batch: sum several losses first (``accumulate`` counts the calls).
        """
        if self.precision.scaler is not None and not self._optimizers:
            raise RuntimeError(
                "precision='16-mixed' scales the loss, so the optimizer must unscale it: pass the optimizer to "
                "strategy.prepare(model, optimizer), or use strategy.train_step"
            )
        self._micro_steps += 1
        if self._accumulation_steps > 1:
            loss = loss / self._accumulation_steps
        with self._guard():
            self.precision.scale(loss).backward(**kwargs)
        self.step_recorder.backward_done()
        if self._accumulation_steps > 1:  # DDP decides in the forward pass whether its backward syncs
            self._set_gradient_sync((self._micro_steps + 1) % self._accumulation_steps == 0)

    def _update_applied(self) -> bool:
        """Whether the last ``optimizer.step()`` updated the parameters; ``train_step`` steps its scheduler only then."""
        return True

    def _may_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a prepared optimizer's step/zero_grad acts now; one optimizer per accumulate() cycle."""
        if self._accumulation_steps > 1:
            if self._accumulating is None:
                self._accumulating = optimizer
            elif self._accumulating is not optimizer:
                raise RuntimeError(
                    "accumulate() counts one backward per micro-batch, so it cannot tell a second optimizer's "
                    "backward (a GAN's) from the next micro-batch: use one accumulate() per optimizer's loop, or "
                    "strategy.train_step(..., accumulate=k) for each model"
                )
        return self.sync_gradients

    @property
    def sync_gradients(self) -> bool:
        """Whether the last ``backward`` ended an accumulation cycle: its gradients are synced
        and ``optimizer.step()`` updates. Step an LR scheduler, clip or log only when it is True."""
        return self._micro_steps % self._accumulation_steps == 0

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the gradients of ``optimizer``'s parameters to a total norm of ``max_norm``, after their sync.

        For the eager loop, between ``backward`` and ``optimizer.step()``. fp16 gradients are
        unscaled first, once (the step does not unscale them again). Inside an accumulation
        cycle it does nothing and returns None; otherwise it returns the norm before clipping.
        """
        if not self.sync_gradients:
            return None
        self.precision.unscale(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return self._clip_grad_norm(params, max_norm, norm_type)

    def _clip_grad_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Replicated gradients: the local norm is the global one. Sharded strategies reduce it."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def _set_gradient_sync(self, enabled: bool) -> None:
        """Whether the next forward/backward synchronises gradients (DDP's require_backward_grad_sync)."""

    @contextmanager
    def accumulate(self, steps: int) -> Iterator[None]:
        """Inside, gradients of ``steps`` consecutive micro-batches are summed before each update.

        The first ``steps - 1`` micro-batches skip the all-reduce (DDP's ``no_sync``, decided
        before their forward pass), ``backward`` scales the loss by ``1/steps``, and
        ``optimizer.step()`` and ``zero_grad()`` act only on the last, so the loop itself does
        not change. An update over k micro-batches of size b equals one over a batch of k*b.
        ``strategy.sync_gradients`` says whether the last ``backward`` ended a cycle: step an LR
        scheduler only then. ``train_step(..., accumulate=k)`` does all of this by itself.
        """
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"accumulate() takes a positive number of micro-steps, got {steps!r}")
        if self._accumulation_steps != 1:
            raise RuntimeError("accumulate() is already active; nest the loop in one accumulate() only")
        self._accumulation_steps, self._micro_steps, self._accumulating = steps, 0, None
        self._set_gradient_sync(steps == 1)
        try:
            yield
        finally:
            micro_steps = self._micro_steps
            self._accumulation_steps, self._micro_steps, self._accumulating = 1, 0, None
            self._set_gradient_sync(True)
        _check_cycles_ended(steps, micro_steps)

    # ---- data -------------------------------------------------------------------------------
    def distribute(
        self,
        data: Dataset | DataLoader | Pipeline | Iterable[Any],
        batch_size: int | None = None,
        shuffle: bool | None = None,
        seed: int = 0,
        drop_last: bool | None = None,
        num_workers: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shard_by: str = "auto",
    ) -> DistributedLoader | PipelineLoader:
        """This replica's share of ``data`` in global batches of ``batch_size``.

        Order: replica r gets the r-th contiguous slice of every global batch, and N replicas'
        slices together are exactly 1 replica's global batch. A replica's slices of successive
        batches are not successive samples (shuffled by default, ``shuffle=None`` meaning True);
        for a model that carries state from one step to the next, pass
        ``loom.data.stream_batches(tokens, batch_size, seq_len)``, whose row i continues from
        batch to batch on the same replica. The uneven last batch is padded to equal slices;
        ``valid_count(k)`` of the returned loader says how many of batch k's samples are real.

        A ``DataLoader`` keeps its sampler (sharded over replicas), shuffle, drop_last, workers
        and collate_fn; its ``batch_size`` is the global batch; ``shuffle``/``drop_last`` given
        here must agree with it. A ``loom.data.Pipeline`` keeps its own order, workers and
        batching (``batch_size`` defaults to its ``batch()``) and is split over replicas by file
        or by sample (``shard_by``, see ``loom.data.plan``). See ``loom.data.sharding`` for the
        details.
        """
        self._announce()
        if isinstance(data, Pipeline):
            return data.loader(self.num_replicas_in_sync, self.replica_id, self.device, batch_size, shard_by)
        return DistributedLoader(
            data,
            batch_size,
            self.num_replicas_in_sync,
            self.replica_id,
            self.device,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            num_workers=num_workers,
            collate_fn=collate_fn,
        )

    # ---- cross-replica values ---------------------------------------------------------------
    _replica_group: Any = None  # the replicas' process group (None: every process is a replica)

    def reduce(self, value: torch.Tensor | Number, op: str = "mean", axis: int | None = None) -> torch.Tensor | Number:
        """Combine a tensor or a Python number over all replicas; every replica gets the result.

        ``op`` is one of ``loom.comm``'s: sum, mean, max, min, product. TF's order and names work
        too: ``reduce(ReduceOp.SUM, value, axis=None)`` (see ``tf_compat.reduce_arguments``).
        """
        value, op = reduce_arguments(value, op, axis)
        return cross_replica.reduce(value, op, self._transport(), self.device)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every replica's ``tensor`` concatenated along dim 0 in replica order (sizes may differ)."""
        return cross_replica.gather(tensor, self._transport())

    def _transport(self) -> cross_replica.Transport:
        """How this strategy's replicas meet for ``reduce`` and ``gather``: their process group."""
        return cross_replica.GroupTransport(self._replica_group, self._guard)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the chief only, flushed: one line per job, not one per replica."""
        self._announce()
        if self.is_chief:
            print(*args, **{"flush": True, **kwargs})

    def barrier(self) -> None:
        """Wait until every replica gets here."""
        with self._guard():
            comm.barrier()

    def _fast_path_for_parts(self, fast_path: bool | Sequence[str] | None, why: str = PARTS) -> None:
        """``prepare``'s fast path for a strategy whose processes each hold part of the model (or
        that compiles the step): the trial is refused in one line, the exact allocator applies."""
        refuse_fast_path(type(self).__name__, fast_path, why)
        self._model_in_parts = True
        said = exact.allocator_only(fast_path) if self.device.type == "cpu" else None
        if said:
            self.print(said, file=sys.stderr)

    def _guard(self) -> ContextManager[None]:
        return self._connection.guard() if self._connection is not None else nullcontext()

    # ---- checkpoints -------------------------------------------------------------------------
    def save(
        self,
        directory: str | Path,
        *,
        step: int | None = None,
        keep: int = 3,
        async_save: bool = False,
        durable: bool = True,
        **state: Any,
    ) -> Path:
        """Save ``state`` as ``directory/step-<step>``; every replica calls it at the same point.

        ``state`` names what to keep: models, optimizers, anything with ``state_dict`` (the
        loader from ``distribute``, LR schedulers), tensors and JSON values. Restorable under
        any strategy and number of replicas; see ``loom.checkpoint``. ``step`` defaults to the
        one after the newest checkpoint in ``directory``. The last ``keep`` checkpoints are
        kept. With ``async_save`` training goes on while it is written. ``durable`` fsyncs
        every file before the commit, so a machine that loses power keeps it too. A replica
        that does not call it is named within ``LOOM_SAVE_TIMEOUT`` seconds (60).
        """
        peers = self._connection.monitor if self._connection is not None else None
        scalers = {f"{name}{SCALER_SUFFIX}": v.scaler.state_dict() for name, v in scaled_optimizers(state).items()}
        with self._guard():
            return self._checkpointer.save(directory, step, {**unwrapped_state(state), **scalers}, keep, async_save, durable, peers)

    def restore(
        self, directory: str | Path, *, fallback: bool = False, strict: bool = True, **state: Any
    ) -> dict[str, Any] | None:
        """Load the newest complete checkpoint under ``directory`` into ``state``'s objects, in place.

        Returns the saved plain values and ``step``, or None when there is no checkpoint yet.
        ``fallback=True`` passes over a damaged checkpoint to the one before it.
        ``strict=False`` loads the tensors that the checkpoint and ``state`` both have (a
        pretrained body into a model with a new head); the others are returned as
        ``missing_keys`` and ``unexpected_keys``, and warned about once.
        """
        peers = self._connection.monitor if self._connection is not None else None
        with self._guard():
            restored = self._checkpointer.restore(directory, unwrapped_state(state), fallback, strict, peers)
        for name, optimizer in scaled_optimizers(state).items():  # an fp32 checkpoint leaves the scaler fresh
            saved = restored.pop(f"{name}{SCALER_SUFFIX}", None) if restored else None
            if saved is not None:
                optimizer.scaler.load_state_dict(saved)
        for name in state if restored else ():  # an fp16 checkpoint restored in fp32: its scaler is loom's, not a value
            restored.pop(f"{name}{SCALER_SUFFIX}", None)
        return restored

    @cached_property
    def step_recorder(self) -> Any:
        """Times every step on this rank (``loom.diagnostics.breakdown``); hooked by ``prepare``."""
        from loom.diagnostics.breakdown import StepRecorder  # a leaf module: diagnostics sits above strategies

        return StepRecorder(self)

    def report(self, loader: Any = None, log_dir: str | None = None, show: bool = True) -> Any:
        """Where step time went on every rank since the last report, and the verdict; on every replica.

        The chief prints the table (``show``); with ``log_dir`` it also writes TensorBoard scalars,
        JSON and a PNG of stacked bars per rank in ``log_dir/breakdown``. ``loader`` (from ``distribute``) lets an input-bound verdict name its stage.
        """
        from loom.diagnostics.report import report

        return report(self, loader=loader, log_dir=log_dir, show=show)

    def job_report(self) -> dict[str, float] | None:
        """Figures about the whole job that only some strategies have (parameter servers); else None."""
        return None

    def preempted(self) -> bool:
        """Whether any process got SIGTERM since ``loom.comm.preemption.arm()``; call it on every replica.

        True on every process at once (a replica's model-parallel ranks too, which save together),
        so they can save together after the same step.
        """
        flag = torch.tensor(float(preemption.requested()), device=self.device)
        with self._guard():
            comm.all_reduce(flag, "max")
        return bool(flag)

    @cached_property
    def _checkpointer(self) -> Checkpointer:
        from loom.checkpoint.checkpointer import Checkpointer  # imports DCP: only a job that saves pays for it

        return Checkpointer(type(self).__name__)

    def shutdown(self) -> None:
        """Leave the job's process group (also done at exit), once a pending checkpoint is written."""
        if "_checkpointer" in self.__dict__:
            self._checkpointer.wait()
        if self._connection is not None:
            self._connection.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(replicas={self.num_replicas_in_sync}, replica={self.replica_id}, "
            f"device={self.device}, precision={self._precision_name!r})"
        )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _check_cycles_ended(steps: int, micro_steps: int) -> None:
    """Refuse an accumulate() that never reached an update; warn about a cycle left half done.

    Each accumulate() counts from zero, so one entered per iteration (as Accelerate's
    ``accumulate(model)`` is) would never step the optimizer.
    """
    if 0 < micro_steps < steps:
        raise RuntimeError(
            f"accumulate({steps}) ended after {micro_steps} micro-step(s), before its first update, so nothing "
            f"was trained: wrap the whole loop in it (with strategy.accumulate({steps}): for x, y in loader: ...), "
            "not each iteration as with Accelerate's accumulate(model)"
        )
    if micro_steps % steps:
        warnings.warn(
            f"accumulate({steps}) ended {micro_steps % steps} micro-step(s) into a cycle; their gradients are "
            "still in .grad and join the next update (make the steps per epoch a multiple of it)",
            stacklevel=4,
        )
