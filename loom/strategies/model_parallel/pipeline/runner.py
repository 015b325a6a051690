"""One process's share of a pipeline: its stages, the schedule that runs them, and inference.

Kept apart from the strategy so that a hybrid runs the same pipeline on a sub-mesh: it takes
the pp axis's process group, and knows nothing about data parallelism.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom.comm import collective_log
from loom.compat import compile_like
from loom.strategies.outputs import map_outputs, model_loss
from loom.strategies.model_parallel.pipeline.split import Layers, LastStage, build_stage, tensors_in, to_meta
from loom.strategies.precision import Precision
from loom.strategies.step import _detached, batch_len, slice_batch

# name -> (torch's schedule class in torch.distributed.pipelining, stages per process: None for two or more).
# That module is imported when the first schedule is built: it costs seconds and imports torch._dynamo.
SCHEDULES: dict[str, tuple[str, int | None]] = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", None),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", None),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", 2),
}


EVERY_STAGE = (
    "under a pipeline every stage must run each forward and training step, evaluation included: call it on every "
    "rank, with no `if strategy.is_chief:` around it (print or save on the chief only, after it)"
)


def _exchange(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Record the method's sends and receives between stages as one call that every stage makes,
    so that a hang names the stage that ran another one (torch does not record gloo's sends)."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def run(self: PipelineRunner, *args: Any, **kwargs: Any) -> Any:
            group = "pp" if self.group is None else f"pp {self.group.group_name}"
            with collective_log.exchange(op, group, EVERY_STAGE):
                return method(self, *args, **kwargs)

        return run

    return wrap


def stage_owners(schedule: str, processes: int, virtual_stages: int) -> list[int]:
    """The process (in the pp group) of every stage: looped, or V-shaped for ZBV (r holds r and 2N-1-r)."""
    total = processes * virtual_stages
    if schedule == "zbv_zero_bubble":
        return [s if s < processes else total - 1 - s for s in range(total)]
    return [s % processes for s in range(total)]


class PipelineRunner:
    """Runs this process's stages of ``layers`` (cut at ``bounds``) in a schedule over ``group``."""

    def __init__(
        self,
        layers: Layers,
        bounds: Sequence[int],
        schedule: str,
        microbatches: int,
        virtual_stages: int,
        device: torch.device,
        precision: Precision,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group
        self.bounds = list(bounds)
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        processes = dist.get_world_size(group) if dist.is_initialized() else 1
        self.owners = stage_owners(schedule, processes, virtual_stages)
        self.num_stages = len(self.owners)
        self.mine = [s for s, owner in enumerate(self.owners) if owner == self.rank]
        self.sequential = layers.list_name is None  # an nn.Sequential: its stages never run the model's forward
        self.modules = {s: build_stage(layers, bounds, s) for s in self.mine}
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.device = device
        self.precision = precision
        self._schedule: Any = None
        self._scheduled: dict[int, ScheduledStage] = {}  # the stages as the schedule runs them, built with it
        self._shapes: Any = None  # of the first step's micro-batch: torch's schedules keep them
        self._loss: Callable[[Any, Any], torch.Tensor] | None = None  # None: the model computes its own loss
        self._scale = 1.0
        self._losses: list[torch.Tensor] = []

    @property
    def first(self) -> bool:
        return 0 in self.mine

    @property
    def last(self) -> bool:
        return self.num_stages - 1 in self.mine

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def _build(self) -> Any:
        from torch.distributed import pipelining

        name, per_process = SCHEDULES[self.schedule_name]
        cls, PipelineStage = getattr(pipelining, name), pipelining.PipelineStage
        self._scheduled = {s: ScheduledStage(self.precision.wrap(self.modules[s]), self.device) for s in self.mine}
        stages = [PipelineStage(self._scheduled[s], s, self.num_stages, self.device, group=self.group) for s in self.mine]
        options = dict(n_microbatches=self.microbatches, loss_fn=self._compute_loss, scale_grads=False)
        return cls(stages[0], **options) if per_process == 1 else cls(stages, **options)

    def _compute_loss(self, outputs: Any, target: Any) -> torch.Tensor:
        outputs = self._scheduled[self.num_stages - 1].rebuild(outputs)
        loss = model_loss(outputs) if self._loss is None else self._loss(outputs, target)
        self._losses.append(loss.detach())
        return self.precision.scale(loss * self._scale)

    def _check_shapes(self, inputs: Any, targets: Any) -> None:
        shapes = (_shapes(slice_batch(inputs, 0, self._micro)), _shapes(slice_batch(targets, 0, self._micro)))
        if self._shapes is None:
            self._shapes = shapes
        elif shapes != self._shapes:
            raise ValueError(
                f"PipelineStrategy: this batch's micro-batches are {_describe(shapes)} but the pipeline was built for "
                f"{_describe(self._shapes)} at its first step (torch's schedules fix the shapes sent between stages): "
                "give every batch the same shape (drop_last=True in distribute() or on the DataLoader given to fit; "
                "pad sequences to one length)"
            )

    @_exchange("pipeline step")
    def step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None, scale: float) -> tuple[torch.Tensor, Any]:
        """Forward and backward of one batch: every process gets the batch's mean loss and its outputs.

        Each micro-batch's loss is multiplied by ``scale / microbatches`` before its backward,
        so the gradients are those of ``scale`` times the batch's mean loss. With ``loss_fn``
        None the model computes its own: the first and last stages run its forward with each
        micro-batch's targets, and the loss is read from the last stage's outputs.
        """
        self._micro = batch_len(inputs) // self.microbatches
        self._check_shapes(inputs, targets)
        if self._schedule is None:
            self._schedule = self._build()
        self._loss, self._scale, self._losses = loss_fn, scale / self.microbatches, []
        own_loss = loss_fn is None and targets is not None
        chunks = [slice_batch(targets, i * self._micro, (i + 1) * self._micro) for i in range(self.microbatches)] if own_loss else None
        for s in {0, self.num_stages - 1} & set(self.mine):  # the stages that run the model's forward
            self._scheduled[s].feed(chunks)
        if self.last:
            last = self.modules[self.num_stages - 1]
            if isinstance(last, LastStage):
                last.example = slice_batch(inputs, 0, self._micro)
        args = (inputs,) if self.first else ()
        target = (targets if targets is not None else torch.zeros(batch_len(inputs))) if self.last else None
        outputs = self._schedule.step(*args, target=target)
        outputs = self._scheduled[self.num_stages - 1].rebuild(outputs) if self.last else None
        # the first step also computes a loss while torch infers the shapes: the schedule's are the last ones
        loss = torch.stack(self._losses[-self.microbatches :]).mean() if self.last else torch.zeros((), device=self.device)
        return self._from_last(loss), self._from_last(outputs)

    @property
    def scheduled_batch(self) -> int | None:
        """The batch size the schedule was built for at the first step (None before it)."""
        return None if self._shapes is None else self._micro * self.microbatches

    @_exchange("pipeline step")
    def step_whole(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None, scale: float) -> tuple[torch.Tensor, Any]:
        """Forward and backward of a batch smaller than the schedule's (an epoch's short last one), unpipelined.

        torch's schedules keep the shapes of their first step, so this batch goes as one
        micro-batch: forward stage after stage, then backward from the last stage to the first.
        Its gradients are those of ``scale`` times its mean loss, as ``step`` gives.
        """
        held: dict[int, tuple[Any, Any]] = {}  # stage -> (its input, its output)
        for s in self.mine:
            if s == 0:
                x = inputs
            else:
                x = held[s - 1][1].detach() if self.owners[s - 1] == self.rank else _receive(self._global(self.owners[s - 1]), self.group, self.device)
                x.requires_grad_(x.is_floating_point())
            module = self.modules[s]
            if isinstance(module, LastStage):
                module.example = inputs
            with self.precision.autocast():
                held[s] = (x, module(x, *self._targets_of(s, targets, loss_fn is None)))
            if s < self.num_stages - 1 and self.owners[s + 1] != self.rank:
                _send(held[s][1].detach(), self._global(self.owners[s + 1]), self.group)
        loss, outputs = torch.zeros((), device=self.device), None
        for s in reversed(self.mine):
            x, out = held[s]
            if s == self.num_stages - 1:
                value = model_loss(out) if loss_fn is None else loss_fn(out, targets if targets is not None else torch.zeros(batch_len(inputs)))
                loss, outputs = value.detach(), _detached(out)
                self.precision.scale(value * scale).backward()
            else:
                grad = held[s + 1][0].grad if self.owners[s + 1] == self.rank else _receive(self._global(self.owners[s + 1]), self.group, self.device)
                out.backward(grad)
            if s > 0 and self.owners[s - 1] != self.rank:
                _send(x.grad if x.grad is not None else torch.zeros_like(x), self._global(self.owners[s - 1]), self.group)
        return self._from_last(loss), self._from_last(outputs)

    def _targets_of(self, stage: int, targets: Any, own_loss: bool) -> tuple[Any, ...]:
        """What stage ``stage`` is given besides its input: the targets, where it runs the forward of a model computing its own loss."""
        return (targets,) if own_loss and targets is not None and stage in (0, self.num_stages - 1) else ()

    @torch.no_grad()
    @_exchange("pipeline forward")
    def forward(self, inputs: Any, *targets: Any) -> Any:
        """The whole model on ``inputs`` (and ``targets``, for a model computing its own loss), stage after
        stage (no schedule, any batch size); every process gets the outputs."""
        activation: Any = None
        for s in range(self.num_stages):
            owner = self.owners[s]
            if owner != self.rank:
                continue
            if s == 0:
                activation = inputs
            elif self.owners[s - 1] != self.rank:
                activation = _receive(self._global(self.owners[s - 1]), self.group, self.device)
            module = self.modules[s]
            if isinstance(module, LastStage):
                module.example = inputs
            with self.precision.autocast():
                activation = module(activation, *self._targets_of(s, targets[0] if targets else None, True))
            if s < self.num_stages - 1 and self.owners[s + 1] != self.rank:
                _send(activation, self._global(self.owners[s + 1]), self.group)
        return self._from_last(activation if self.last else None)

    def _from_last(self, tree: Any) -> Any:
        """``tree`` from the process of the last stage, on every process of the pipeline."""
        if self.num_stages == len(self.mine):
            return tree
        src = self._global(self.owners[-1])
        header = [_header(tree) if self.last else None]
        dist.broadcast_object_list(header, src=src, group=self.group)
        return _broadcast_tensors(tree if self.last else None, header[0], src, self.group, self.device)

    def compile_like(self, compiled: nn.Module) -> None:
        """Compile each block of this process's stages as ``compiled`` (``torch.compile(model)``) was."""
        for module in self.modules.values():
            for block in getattr(module, "blocks", None) or module.layers:
                compile_like(compiled, block)

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for module in self.modules.values():
            for p in module.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())


class ScheduledStage(nn.Module):
    """A stage as torch's schedule runs it: shape inference that changes nothing, tensors out.

    The schedule's first call is torch's shape inference, a real forward (and backward) on the
    first micro-batch or on uninitialised tensors. It runs here on copies of the stage's
    buffers and with the random generators put back after, so no running statistic, counter
    or dropout draw depends on when the schedule was built (a resumed run builds it again).
    The stage's outputs go to torch as a tuple of their tensors, and ``rebuild`` puts the
    model's structure back, of the model's own classes (``(logits, None)``, a ``ModelOutput``:
    torch's stages take tensors only). A scalar (a loss) goes as one element, since torch joins
    the micro-batches' outputs along their first dimension; the joined outputs keep the last one's.
    A stage that runs the forward of a model computing its own loss is fed each micro-batch's
    targets, in order (the schedule runs a stage's micro-batches in order).
    """

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.module = module
        self.device = device
        self.inferring = True
        self.structure: Any = None  # the last output, its tensors on the meta device
        self.targets: list[Any] | None = None  # this step's micro-batches' targets, for a model's own loss
        self.calls = 0

    def feed(self, targets: list[Any] | None) -> None:
        """This step's micro-batches' targets (None: the model is called without them)."""
        self.targets, self.calls = targets, 0

    def forward(self, *args: Any) -> Any:
        if self.targets is not None:  # shape inference runs on the first micro-batch, then the schedule runs them in order
            args = (*args, self.targets[0 if self.inferring else self.calls])
            if not self.inferring:
                self.calls += 1
        if self.inferring:
            self.inferring = False
            from torch.func import functional_call  # torch.func imports functorch: only where a stage runs

            buffers = {name: b.clone() for name, b in self.module.named_buffers()}
            with torch.random.fork_rng(devices=[self.device] if self.device.type != "cpu" else [], device_type=self.device.type):
                out = functional_call(self.module, buffers, args, strict=False)
        else:
            out = self.module(*args)
        self.structure = to_meta(out)
        tensors = [t.reshape(1) if t.dim() == 0 else t for t in tensors_in(out)]
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    def rebuild(self, flat: Any) -> Any:
        """The stage's outputs in the model's structure, from the tensors ``forward`` handed on
        (one micro-batch's, or the schedule's join of them all)."""
        tensors = iter(flat if isinstance(flat, tuple) else (flat,))
        return map_outputs(lambda v: _leaf(next(tensors), v) if isinstance(v, torch.Tensor) else v, self.structure)


def _leaf(tensor: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """A scalar output went as one element per micro-batch: the last one's."""
    return tensor.reshape(-1)[-1] if meta.dim() == 0 else tensor


def _shapes(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return (tuple(tree.shape), tree.dtype)
    if isinstance(tree, (list, tuple)):
        return tuple(_shapes(t) for t in tree)
    if isinstance(tree, dict):
        return tuple((k, _shapes(v)) for k, v in tree.items())
    return None


def _describe(shapes: Any) -> str:
    inputs, targets = shapes
    first = lambda s: list(s[0]) if isinstance(s, tuple) and s and isinstance(s[0], tuple) and all(isinstance(d, int) for d in s[0]) else s  # noqa: E731
    return f"inputs {first(inputs)}, targets {first(targets)}"


class _Slot:
    """Where a broadcast output holds a tensor: its shape and dtype (a leaf to ``map_outputs``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype


def _header(tree: Any) -> Any:
    """``tree`` with each tensor replaced by its ``_Slot``: its containers' classes travel with it."""
    return map_outputs(lambda v: _Slot(v) if isinstance(v, torch.Tensor) else v, tree)


def _broadcast_tensors(tree: Any, header: Any, src: int, group: Any, device: torch.device) -> Any:
    """The tensors of ``tree`` (on ``src``) into ``header``'s structure, on every process."""
    sent = iter(tensors_in(tree)) if tree is not None else None

    def fill(slot: Any) -> Any:
        if not isinstance(slot, _Slot):
            return slot
        tensor = next(sent).detach().contiguous() if sent is not None else torch.empty(slot.shape, dtype=slot.dtype, device=device)
        dist.broadcast(tensor, src=src, group=group)
        return tensor

    return map_outputs(fill, header)


def _send(tensor: Any, dst: int, group: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"a pipeline stage must hand a single tensor to the next one, not {type(tensor).__name__}")
    dist.send_object_list([(tuple(tensor.shape), tensor.dtype)], dst=dst, group=group)
    dist.send(tensor.contiguous(), dst=dst, group=group)


def _receive(src: int, group: Any, device: torch.device) -> torch.Tensor:
    meta: list[Any] = [None]
    dist.recv_object_list(meta, src=src, group=group)
    tensor = torch.empty(meta[0][0], dtype=meta[0][1], device=device)
    dist.recv(tensor, src=src, group=group)
    return tensor

