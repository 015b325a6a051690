"""Pipeline parallelism: the model's layers cut into stages, one stage per process.

Built on ``torch.distributed.pipelining``: its stages and schedules (GPipe, 1F1B, interleaved
1F1B, zero bubble) run each batch as micro-batches flowing through the stages. The split is
automatic (``loom.strategies.model_parallel.pipeline.split``), and a process keeps only its stage: the other
stages' weights in the module it was given are released (meta tensors).

Every process of the pipeline reads the same global batch: the first stage feeds the inputs,
the last computes the loss from the targets, and each checks the batch's shape. The loss and
the outputs are broadcast from the last stage, so ``train_step`` returns the same loss
everywhere and ``fit`` computes its metrics on every process. The eager loop cannot run:
forward and backward are interleaved by the schedule, so ``backward`` refuses and points to
``train_step``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loom import comm
from loom.cluster import TorchrunEnvironment
from loom.compat import compiled_module_type, compiled_original
from loom.comm import Connection, preemption
from loom.devices import apply_thread_budget, local_device
from loom.errors import CheckpointMismatchError, LaunchError
from loom.strategies import cross_replica
from loom.strategies.base import Strategy, unwrap
from loom.strategies.model_parallel.dtensor_norm import clip_grad_norm
from loom.strategies.model_parallel.mesh import broadcast_states
from loom.strategies.optimizer import StrategyOptimizer, check_owned
from loom.strategies.model_parallel.pipeline.runner import SCHEDULES, PipelineRunner
from loom.strategies.model_parallel.pipeline.state import held_tensors, named_groups, stage_view
from loom.strategies.model_parallel.pipeline.split import Layers, check_untied, describe, find_layers, owned_tensors, refuse_batchnorm, split_bounds, time_costs
from loom.strategies.precision import AutocastModule, canonical
from loom.strategies.step import TrainStep, _concat, batch_len, slice_batch

_SAVE_OPTIONS = ("step", "keep", "async_save", "durable")
EAGER_REFUSAL = (
    "PipelineStrategy runs forward and backward together in its schedule, so the eager loop (model(x) with "
    "gradients, strategy.backward) cannot run: use step = strategy.train_step(model, loss_fn, optimizer) and "
    "loss = step(inputs, targets), or loom.fit"
)


class PipelineStrategy(Strategy):
    """Cuts the model into ``stages`` (one per process) and trains it with a pipeline schedule.

    Args:
        stages: processes in the pipeline; an error if the launch disagrees (default: all of them).
        microbatches: micro-batches per batch (default: the number of stages); must divide it.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``, ``"interleaved_zero_bubble"``
            or ``"zbv_zero_bubble"`` (two stages per process).
        virtual_stages: stages per process, for the interleaved and zero-bubble schedules.
        balance: ``"params"`` (equal parameter counts) or ``"time"`` (equal measured forward and
            backward time, on ``example_inputs``, by the first process).
        split_points: the layers that start stages 1, 2, ... (``["blocks.4", "blocks.8"]``),
            instead of balancing.
        example_inputs: a batch of inputs, for ``balance="time"``.
        precision: ``"32"`` or ``"bf16-mixed"``; ``"16-mixed"`` is refused (one stage's fp16
            overflow would have to skip the step on every stage).
        timeout: seconds a collective may wait (default ``LOOM_TIMEOUT``, else 300).
        group: the pp axis: a process group or a 1-D DeviceMesh (a hybrid's sub-mesh); default
            the whole job, which this strategy then joins.
        dp_group: the dp axis, when pipelines are replicated: gradients are averaged over it,
            and data is sharded over it.
    """

    def __init__(
        self,
        stages: int | None = None,
        microbatches: int | None = None,
        schedule: str = "1f1b",
        virtual_stages: int = 1,
        balance: str = "params",
        split_points: Sequence[str] | None = None,
        example_inputs: Any = None,
        precision: str = "32",
        timeout: float | None = None,
        backend: str | None = None,
        group: Any = None,
        dp_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(precision=precision, timeout=timeout)
        _check_options(schedule, virtual_stages, balance, example_inputs, precision)
        if not TorchrunEnvironment.detect():
            raise LaunchError(
                "PipelineStrategy runs one stage per process: start the script with `loom run --nproc N script.py` "
                "or call loom.launch(main) in it"
            )
        cluster = TorchrunEnvironment.resolve()
        self._device = local_device(cluster.local_rank)
        if group is None:
            if self._device.type == "cpu":
                apply_thread_budget(cluster.local_world_size)
            self._connection = Connection.join(cluster, self._device, self.timeout, backend)
        self.group = group.get_group() if hasattr(group, "get_group") else group
        self.dp_group = dp_group
        processes = comm.world_size(self.group)
        if stages is not None and stages != processes:
            raise ValueError(
                f"PipelineStrategy(stages={stages}) runs one stage per process, and the pipeline has {processes} "
                f"process(es): launch it with {stages} (loom run --nproc {stages}) or drop stages="
            )
        self.stages = processes
        self.virtual_stages = virtual_stages
        self.microbatches = microbatches if microbatches is not None else processes * virtual_stages
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive number, got {self.microbatches}")
        self.schedule, self.balance, self.split_points, self.example_inputs = schedule, balance, split_points, example_inputs
        self._split: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # the modules prepare() cut: save and restore take them too

    # ---- topology ---------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return comm.world_size(self.dp_group) if self.dp_group is not None else 1

    @property
    def replica_id(self) -> int:
        return comm.rank(self.dp_group) if self.dp_group is not None else 0

    @property
    def is_chief(self) -> bool:
        return comm.rank() == 0

    @property
    def model_parallel_degrees(self) -> dict[str, int]:
        return {"pipeline stage": self.stages}

    @property
    def device(self) -> torch.device:
        return self._device

    # ---- model and optimizer ----------------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Any = None, *, fast_path: bool | Sequence[str] | None = None, example_input: Any = None) -> Any:
        """Cut ``model`` into stages, keep this process's, and build the optimizer on its parameters.

        The other stages' parameters in ``model`` become meta tensors (not held here). A given
        optimizer loses those parameters; a factory gets only this stage's.
        """
        self._fast_path_for_parts(fast_path)
        if not isinstance(model, nn.Module):
            raise TypeError(f"prepare() takes an nn.Module, not {type(model).__name__}")
        self._announce()  # the job's first line, before the split's description
        compiled, model = _compiled(model), unwrap(model)  # torch.compile(model): its stages' blocks are compiled alike
        if isinstance(optimizer, torch.optim.Optimizer):
            check_owned(optimizer, model.parameters())
        if self.dp_group is None and self.group is None:  # Hybrid broadcasts to every replica before it splits
            with self._guard():
                broadcast_states(model, self._device)  # each stage starts from rank 0's model, whatever each rank seeded
        layers = find_layers(model, self.split_points)
        refuse_batchnorm(model)
        bounds = self._bounds(layers)
        check_untied(layers, bounds)
        self.print(describe(layers, bounds))
        with self._guard():
            runner = PipelineRunner(layers, bounds, self.schedule, self.microbatches, self.virtual_stages, self._device, self.precision, self.group)
        owned = owned_tensors(layers, bounds, runner.mine)
        _release(model, owned)
        self._split.add(model)
        for tensor in owned.values():
            tensor.data = tensor.data.to(self._device)
        if compiled is not None:
            runner.compile_like(compiled)
        wrapped = PipelineModule(model, self, runner)
        if optimizer is None:
            return wrapped
        params = [p for p in model.parameters() if not p.is_meta]
        if isinstance(optimizer, torch.optim.Optimizer):
            inner, kept = optimizer, {id(p) for p in params}
            for group in inner.param_groups:  # the other stages' parameters are gone from the model
                group["params"] = [p for p in group["params"] if id(p) in kept]
        elif callable(optimizer):
            inner = optimizer(params)
        else:
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory, not {type(optimizer).__name__}")
        self._optimizers += 1
        return wrapped, StrategyOptimizer(inner, self.precision, self._may_step)

    def _bounds(self, layers: Layers) -> list[int]:
        total = self.stages * self.virtual_stages
        if self.balance != "time" or self.split_points is not None:
            return split_bounds(layers, total, self.split_points)
        chosen: list[Any] = [None]
        if comm.rank(self.group) == 0:
            costs = time_costs(layers, self.example_inputs)
            chosen[0] = split_bounds(layers, total, costs=costs)
        if comm.world_size(self.group) > 1:
            with self._guard():
                dist.broadcast_object_list(chosen, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return chosen[0]

    def train_step(self, model: nn.Module, loss_fn: Any, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                   max_grad_norm: float | None = None, accumulate: int = 1) -> TrainStep:  # fmt: skip
        """The step runs the schedule; see ``Strategy.train_step``. Batches must split into
        ``accumulate * microbatches`` equal micro-batches, and keep the first one's shape; a
        smaller batch (an epoch's short last one) runs unpipelined, stage after stage, as one
        micro-batch, and gives the same update."""
        return PipelineStep(self, self.prepared_stages(model), loss_fn, optimizer, scheduler, max_grad_norm, accumulate)

    def prepared_stages(self, model: nn.Module) -> PipelineModule:
        """What ``prepare`` returned, from ``model``: that, or ``torch.compile`` of it (whose settings
        then compile the stages' blocks: the schedule runs them, not the model's forward)."""
        compiled = _compiled(model)
        stages = compiled_original(compiled) if compiled is not None else model
        if not isinstance(stages, PipelineModule) or stages.strategy is not self:
            raise TypeError(f"{type(self).__name__}.train_step takes the model this strategy's prepare() returned")
        if compiled is not None:
            stages.runner.compile_like(compiled)
        return stages

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        raise RuntimeError(EAGER_REFUSAL)

    def _clip_grad_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of every stage's gradients together: the stages' norms combined over the pp group."""
        with self._guard():
            return clip_grad_norm(params, max_norm, norm_type, (self.group,))

    def _average_over_replicas(self, params: list[nn.Parameter]) -> None:
        if self.dp_group is None:
            return
        with self._guard():
            for p in params:
                if p.grad is not None:
                    comm.all_reduce(p.grad, "mean", self.dp_group)

    def preempted(self) -> bool:
        """Over every process of the job: the stages of a pipeline stop together, not only its replicas."""
        flag = torch.tensor(float(preemption.requested()), device=self._device)
        with self._guard():
            comm.all_reduce(flag, "max")
        return bool(flag)

    # ---- checkpoints: each stage its own tensors, under the whole model's names -----------------
    def save(self, directory: Any, **options: Any) -> Any:  # type: ignore[override]
        """Every stage writes its own tensors; together they are the whole model's checkpoint."""
        state = {k: v for k, v in options.items() if k not in _SAVE_OPTIONS}
        return super().save(directory, **{k: v for k, v in options.items() if k in _SAVE_OPTIONS}, **self._stage_state(state))

    def restore(self, directory: Any, *, fallback: bool = False, strict: bool = True, **state: Any) -> dict[str, Any] | None:
        """Each stage reads its own tensors from a checkpoint of the whole model (saved under any strategy).

        ``strict`` holds for the stages together: a tensor no stage wants, or one a stage
        wants and the checkpoint lacks, is an error.
        """
        staged = self._stage_state(state)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="loom: restored part")
            restored = super().restore(directory, fallback=fallback, strict=False, **staged)
        if restored is None or not strict:
            return restored
        missing, unexpected = restored.pop("missing_keys"), restored.pop("unexpected_keys")
        everyone: list[Any] = [None] * comm.world_size(self.group)
        with self._guard():
            dist.all_gather_object(everyone, set(unexpected), group=self.group)
        unwanted = sorted(set.intersection(*everyone))
        if missing or unwanted:
            key = (missing or unwanted)[0]
            where = "has no tensor" if missing else "has a tensor no stage wants:"
            raise CheckpointMismatchError(
                f"checkpoint does not match: {restored['path']} {where} '{key}'; is it a checkpoint of this model? "
                "(restore(..., strict=False) loads the tensors both have)"
            )
        return restored

    def _stage_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Modules as views of this stage's tensors; their optimizers naming every stage's parameters."""
        staged = dict(state)
        views: list[tuple[nn.Module, dict[str, torch.Tensor]]] = []
        for name, value in state.items():  # what prepare() returned, or the module it was given (compiled or not)
            if isinstance(value, nn.Module) and unwrap(value) in self._split:
                owned = held_tensors(unwrap(value))
                staged[name] = stage_view(unwrap(value), owned)
                views.append((staged[name], owned))
        for name, value in state.items():
            if isinstance(value, torch.optim.Optimizer):
                first = next((p for g in value.param_groups for p in g["params"]), None)
                view = next((v for v, owned in views if any(first is t for t in owned.values())), None)
                if view is not None:
                    with self._guard():
                        staged[name] = named_groups(view, value, self.group)
        return staged

    # ---- cross-replica values: over the dp axis only ----------------------------------------
    def _transport(self) -> cross_replica.Transport:
        """The pipelines replicated over ``dp_group``; one pipeline is one replica."""
        return cross_replica.GroupTransport(self.dp_group, self._guard) if self.dp_group is not None else cross_replica.Alone()


class PipelineModule(AutocastModule):
    """What ``prepare`` returns: the user's module (``loom.unwrap`` peels this wrapper), run as a pipeline.

    Calling it runs inference through every stage (under ``torch.no_grad`` or in eval mode);
    with gradients in training mode it refuses, pointing to ``train_step``.
    """

    def __init__(self, module: nn.Module, strategy: PipelineStrategy, runner: PipelineRunner) -> None:
        super().__init__(module, strategy.precision)
        self.strategy = strategy
        self.runner = runner

    def forward(self, inputs: Any, *targets: Any) -> Any:  # type: ignore[override]
        """``targets``: for a model that computes its own loss (``loom.evaluate(model, None, ...)``)."""
        if self.training and torch.is_grad_enabled():
            raise RuntimeError(EAGER_REFUSAL)
        run = self.runner.forward
        if torch.compiler.is_compiling():  # torch.compile(prepared): the stages' blocks are compiled, not the sends
            run = torch.compiler.disable(run)
        with self.strategy._guard():
            return run(inputs, *targets)


class PipelineStep(TrainStep):
    """``loss = step(inputs, targets)``: the schedule's forward and backward, then the usual update.

    With ``loss_fn=None`` the model computes its own loss: its first and last stages run its
    forward with each micro-batch's targets, ``model(inputs, targets)``, and the loss is read
    from the last stage's outputs (``outputs.model_loss``).
    """

    def __init__(self, strategy: Strategy, model: nn.Module, loss_fn: Any, *args: Any) -> None:
        if loss_fn is None and model.runner.sequential:  # type: ignore[union-attr]
            raise ValueError(
                f"{type(strategy).__name__} runs an nn.Sequential layer by layer, never a forward(inputs, targets) that "
                "computes a loss: pass train_step a loss_fn(outputs, targets)"
            )
        super().__init__(strategy, model, loss_fn, *args)

    def __call__(self, inputs: Any, targets: Any) -> torch.Tensor:
        strategy: PipelineStrategy = self.strategy  # type: ignore[assignment]
        runner: PipelineRunner = self.model.runner  # type: ignore[union-attr]
        if self.loss_fn is None and isinstance(inputs, Mapping):
            raise ValueError(
                f"{type(strategy).__name__} passes a model that computes its own loss its inputs and targets as "
                "model(inputs, targets), not a dict of keywords: give the inputs and the labels as two tensors, or pass a loss_fn"
            )
        size = batch_len(inputs if targets is None else targets)
        k, m = self.accumulate, runner.microbatches
        loss_fn = self.loss_fn if targets is not None or self.loss_fn is None else (lambda out, _: self.loss_fn(out, None))
        full = runner.scheduled_batch
        if full is not None and size < full * k:  # an epoch's short last batch: stage after stage, whole
            with strategy._guard():
                loss, self.outputs = runner.step_whole(inputs, targets, loss_fn, 1.0)
            strategy._average_over_replicas(runner.parameters())
            self._update()
            return loss
        if size % (k * m):
            raise ValueError(
                f"PipelineStrategy(microbatches={m}) with accumulate={k} cannot split a batch of {size} into {k * m} "
                f"equal micro-batches: use a batch size (per replica) divisible by {k * m}"
            )
        losses, outputs = [], []
        for i in range(k):
            a, b = size * i // k, size * (i + 1) // k
            with strategy._guard():
                loss, out = runner.step(slice_batch(inputs, a, b), slice_batch(targets, a, b), loss_fn, 1.0 / k)
            losses.append(loss)
            outputs.append(out)
        strategy._average_over_replicas(runner.parameters())
        self._update()
        self.outputs = outputs[0] if k == 1 else _concat(outputs)
        return torch.stack(losses).mean()


def _check_options(schedule: str, virtual_stages: int, balance: str, example_inputs: Any, precision: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
    needed = SCHEDULES[schedule][1]
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ValueError(f"virtual_stages must be a positive number of stages per process, got {virtual_stages!r}")
    if needed is not None and virtual_stages != needed:
        raise ValueError(f"schedule {schedule!r} runs {needed} stage(s) per process, got virtual_stages={virtual_stages}")
    if needed is None and virtual_stages < 2:
        raise ValueError(f"schedule {schedule!r} interleaves several stages per process: pass virtual_stages=2 or more")
    if balance not in ("params", "time"):
        raise ValueError(f"balance must be 'params' or 'time', got {balance!r}")
    if balance == "time" and example_inputs is None:
        raise ValueError("balance='time' times each layer on an example batch: pass example_inputs=(a batch of inputs)")
    if canonical(precision) == "16-mixed":
        raise ValueError(
            "PipelineStrategy cannot run precision='16-mixed': one stage's fp16 overflow would have to skip the step "
            "on every stage; use precision='bf16-mixed'"
        )


def _compiled(model: nn.Module) -> nn.Module | None:
    """``model`` if it is ``torch.compile``'s wrapper of a module, else None."""
    compiled = compiled_module_type()
    return model if compiled is not None and isinstance(model, compiled) else None


def _release(model: nn.Module, owned: dict[str, torch.Tensor]) -> None:
    """Every parameter and buffer of ``model`` not in ``owned`` becomes a meta tensor (shapes kept, no memory)."""
    keep = {id(t) for t in owned.values()}
    for module in model.modules():
        own = [*module.named_parameters(recurse=False, remove_duplicate=False), *module.named_buffers(recurse=False, remove_duplicate=False)]
        for name, tensor in own:
            if id(tensor) not in keep and not tensor.is_meta:  # setattr keeps a buffer's persistence
                meta = tensor.to("meta")
                setattr(module, name, nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta)
