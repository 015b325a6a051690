"""Data, tensor and pipeline parallelism at once, on one mesh of named axes.

``HybridStrategy(mesh={"dp_shard": 2, "tp": 2})`` lays the processes out as a ``Mesh`` and
composes the parallelisms in one order, torchtitan's:

1. pipeline split (``pp``): each pipeline position keeps its stage of the layers;
2. tensor parallel (``tp``): the stage's Linear pairs, embeddings and output layer split
   (``loom.strategies.model_parallel.tensor_parallel``);
3. activation checkpointing, then ``torch.compile``, each per block (optional);
4. FSDP over the data-parallel axes (``loom.strategies.model_parallel.sharded.shard_model``): ``dp_shard``
   shards parameters, gradients and optimizer state; ``dp`` replicates them (HSDP when both).

Every process of one replica (same ``dp``/``dp_shard`` position) reads the same batch. Before
all of it, every process takes rank 0's values, as DDP does, so that the replicas, the layers
tensor parallelism leaves whole and the shards cut from the others all start from one model.
"""

from __future__ import annotations

from fnmatch import fnmatch
from functools import partial
from typing import Any, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from loom.strategies.base import unwrap
from loom.strategies.model_parallel.dtensor_norm import clip_grad_norm
from loom.strategies.model_parallel.mesh import Mesh, MeshSpec, MeshStrategy, broadcast_states
from loom.strategies.precision import canonical
from loom.strategies.optimizer import StrategyOptimizer
from loom.strategies.model_parallel.pipeline.strategy import EAGER_REFUSAL, PipelineStep, PipelineStrategy
from loom.strategies.model_parallel.sharded import blocks, shard_model
from loom.strategies.step import TrainStep
from loom.strategies.model_parallel.tensor_parallel import Plan, default_plan, resolve_plan, tensor_parallelize, uncompiled


# torch.compile of the whole model around FSDP's hooks fails in torch's tracer ("Mixing fake modes").
COMPILED_REFUSAL = (
    "HybridStrategy compiles each block itself (torch cannot trace the whole model around FSDP's hooks): pass it the "
    "uncompiled model and compile=True (or a backend's name, e.g. compile='aot_eager') instead of torch.compile(model)"
)

# torch.compile(prepared) traces the whole model too: it fails the same way where FSDP shards tensor-parallel weights.
COMPILED_AFTER_REFUSAL = (
    "HybridStrategy cannot run torch.compile(model) over tensor-parallel weights that FSDP shards (torch's tracer "
    "fails on them): call the prepared model uncompiled, and pass HybridStrategy(compile=True) (or a backend's name, "
    "e.g. compile='aot_eager'), which compiles each block"
)


class HybridStrategy(MeshStrategy):
    """Several parallelisms on one mesh: ``mesh={"dp": 2, "pp": 2}``, ``{"dp_shard": 2, "tp": 2}``, ``{"dp": 2, "dp_shard": 2}``.

    Args:
        mesh: the degree of each axis among ``pp``, ``dp``, ``dp_shard``, ``tp`` (one may be
            -1: what the others leave of the job), or a ``loom.Mesh``.
        plan: the tensor-parallel plan (see ``TensorParallelStrategy``), names as in the whole model;
            default plan otherwise.
        microbatches, schedule, split_points: the pipeline's, with a ``pp`` axis (see
            ``PipelineStrategy``); there ``train_step`` runs the schedule and the eager loop refuses.
        activation_checkpointing: recompute each block's activations in backward instead of
            keeping them (blocks as ``loom.strategies.model_parallel.sharded.blocks`` finds them; with a ``pp``
            axis, each of the stage's blocks; the whole model or stage when it has none).
        compile: ``torch.compile`` each block: True with inductor, or the name of another
            backend (``"aot_eager"``: traced and differentiated ahead of time, no code generated).
        precision: ``"32"`` or ``"bf16-mixed"``.
        timeout, backend: as for ``MirroredStrategy``.
    """

    def __init__(
        self,
        mesh: MeshSpec,
        plan: Plan | None = None,
        activation_checkpointing: bool = False,
        compile: bool | str = False,
        microbatches: int | None = None,
        schedule: str = "1f1b",
        split_points: Sequence[str] | None = None,
        precision: str = "32",
        timeout: float | None = None,
        backend: str | None = None,
    ) -> None:
        if canonical(precision) == "16-mixed":
            raise ValueError(
                "HybridStrategy cannot skip an fp16 step that overflowed on one process's part of the model only: "
                "use precision='bf16-mixed', which needs no loss scaling"
            )
        if not isinstance(compile, (bool, str)):
            raise TypeError(f"compile takes True, False or a torch.compile backend's name, not {type(compile).__name__}")
        if isinstance(compile, str) and compile not in torch.compiler.list_backends(exclude_tags=()):  # imports dynamo: only here
            raise ValueError(f"unknown torch.compile backend {compile!r}; choose one of: {', '.join(torch.compiler.list_backends())}")
        super().__init__(mesh, precision=precision, timeout=timeout, backend=backend)
        self.plan = plan
        self.activation_checkpointing = activation_checkpointing
        self.compile = compile
        self._sharded: list[FSDPModule] = []
        self._pipeline: PipelineStrategy | None = None
        self._pp_groups: tuple[Any, ...] = ()  # where the other stages' gradients are, for the global norm
        if "pp" in self.mesh.degrees:
            pp = self.device_mesh["pp"]
            self._pipeline = PipelineStrategy(microbatches=microbatches, schedule=schedule, split_points=split_points,
                                              precision=precision, timeout=timeout, group=pp)  # fmt: skip
            self._pp_groups = (pp.get_group(),)

    def _layout(self, mesh: Mesh) -> Mesh:
        """FSDP replicates over ``dp`` as HSDP does, with shards of one: a ``dp`` axis alone gets a ``dp_shard`` of 1."""
        if "dp" in mesh.degrees and "dp_shard" not in mesh.degrees:
            return Mesh({**mesh.degrees, "dp_shard": 1}, mesh.world_size)
        return mesh

    # ---- composition, in the documented order -------------------------------------------------
    def prepare(self, model: nn.Module, optimizer: Any = None, *, fast_path: bool | Sequence[str] | None = None, example_input: Any = None) -> Any:  # type: ignore[override]
        """Split, parallelise and shard ``model``; build ``optimizer`` on this process's parameters."""
        self._fast_path_for_parts(fast_path)
        if self._pipeline is None or not isinstance(model, nn.Module):
            return super().prepare(model, optimizer)
        self._announce()  # the job's first line, before the split's description
        if optimizer is not None and (isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer)):
            raise TypeError(
                "HybridStrategy with a pp axis builds the optimizer on this stage's parameters once they are sharded: "
                "pass a factory, prepare(model, lambda params: torch.optim.AdamW(params))"
            )
        with self._guard():
            broadcast_states(model, self.device)
        staged = self._pipeline.prepare(model)  # 1. this process keeps its stage; the others' tensors become meta
        with self._guard():
            self._parallelize(unwrap(model), list(staged.runner.modules.values()))  # torch.compile(model): the plan names its layers
        params = [p for p in model.parameters() if not p.is_meta]
        if optimizer is None:
            return staged
        self._optimizers += 1
        return staged, StrategyOptimizer(optimizer(params), self.precision, self._may_step)

    def _wrap_model(self, module: nn.Module) -> nn.Module:
        if uncompiled(module) is not module:
            raise ValueError(COMPILED_REFUSAL)
        broadcast_states(module, self.device)
        self._parallelize(module, [module])
        if self.mesh.size("tp") > 1 and self.mesh.size("dp") * self.mesh.size("dp_shard") > 1:
            module.register_forward_pre_hook(_refuse_compiled_call, prepend=True)  # before FSDP's hooks are traced
        return module

    def _parallelize(self, model: nn.Module, units: list[nn.Module]) -> None:
        """2. tensor parallel on ``model``'s layers this process holds; 3. checkpointing and compile per
        block; 4. FSDP over the data-parallel axes, each of ``units`` (the stages) its own root."""
        if self.mesh.size("tp") > 1:
            held = {n for n, m in model.named_modules() if any(not p.is_meta for p in m.parameters())}
            plan = default_plan(model, self.mesh.size("tp")) if self.plan is None else self.plan
            resolve_plan(model, plan)  # a name that is no module of the model fails here, on every stage
            mine = {name: style for name, style in plan.items() if any(fnmatch(n, name) for n in held)}
            if mine:
                tensor_parallelize(model, self.device_mesh, mine)
        data = tuple(axis for axis in ("dp", "dp_shard") if axis in self.mesh.degrees)
        options: dict[str, Any] = {"backend": self.compile} if isinstance(self.compile, str) else {}
        if self.mesh.size("tp") > 1:  # torch's tracer fails on a split layer whose input has a symbolic length
            options["dynamic"] = False  # so a new sequence length compiles again, as TensorParallelStrategy's docs ask
        for unit in units:
            for block in _blocks(unit):
                if self.activation_checkpointing:
                    block.forward = partial(checkpoint, block.forward, use_reentrant=False)  # keeps the parameters' names
                if self.compile:
                    block.compile(**options)
            if data:
                shard_model(unit, self.device_mesh[data] if len(data) > 1 else self.device_mesh[data[0]])
                self._sharded.append(unit)  # type: ignore[arg-type]

    # ---- the step -----------------------------------------------------------------------------
    def train_step(self, model: nn.Module, loss_fn: Any, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                   max_grad_norm: float | None = None, accumulate: int = 1) -> TrainStep:  # fmt: skip
        if self._pipeline is None:
            return super().train_step(model, loss_fn, optimizer, scheduler, max_grad_norm, accumulate)
        return PipelineStep(self, self._pipeline.prepared_stages(model), loss_fn, optimizer, scheduler, max_grad_norm, accumulate)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self._pipeline is not None:
            raise RuntimeError(EAGER_REFUSAL.replace("PipelineStrategy", "HybridStrategy with a pp axis"))
        super().backward(loss, **kwargs)

    def _average_over_replicas(self, params: list[nn.Parameter]) -> None:
        """The pipeline step's hook: FSDP has already reduced the gradients over the replicas."""

    def _set_gradient_sync(self, enabled: bool) -> None:
        for module in self._sharded:
            module.set_requires_gradient_sync(enabled)

    def _clip_grad_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        with self._guard():
            return clip_grad_norm(params, max_norm, norm_type, self._pp_groups)

    # ---- checkpoints: with a pp axis, each stage saves its own tensors under the whole model's names
    def save(self, directory: Any, **options: Any) -> Any:  # type: ignore[override]
        if self._pipeline is None:
            return super().save(directory, **options)
        with self._guard():
            return self._pipeline.save(directory, **options)

    def restore(self, directory: Any, **options: Any) -> Any:  # type: ignore[override]
        if self._pipeline is None:
            return super().restore(directory, **options)
        with self._guard():
            return self._pipeline.restore(directory, **options)


def _blocks(unit: nn.Module) -> list[nn.Module]:
    """What checkpointing and compile apply to, one by one: a pipeline stage's own blocks (even a single
    one), else the unit's repeated blocks, else the whole unit."""
    own = getattr(unit, "blocks", None)  # a stage of a model whose forward runs a list of blocks
    if isinstance(own, nn.ModuleList) and len(own):
        return list(own)
    return blocks(unit) or [unit]


def _refuse_compiled_call(module: nn.Module, args: Any) -> None:
    """Refuse ``torch.compile(model)``'s trace of the whole model, at its first call (eager calls pass)."""
    if torch.compiler.is_compiling():
        _refuse_compiled()


@torch.compiler.disable
def _refuse_compiled() -> None:
    """Raised where it runs, eagerly: an exception in traced code would only make torch fall back to eager."""
    raise ValueError(COMPILED_AFTER_REFUSAL)
