"""Sharded data parallelism (ZeRO-3) on FSDP2: parameters, gradients and optimizer state split over replicas.

Each replica holds 1/N of every parameter; a block's parameters are all-gathered just before
its forward (and again for its backward) and its gradients reduce-scattered after, so the
whole model exists only one block at a time. ``shard_model`` applies this to a module on any
1-D mesh, or on the data-parallel axes of a larger one (HybridStrategy uses it).

A model built under ``strategy.scope()`` lives on the meta device until ``prepare``, which
allocates only this replica's shards and fills them one module at a time (see
``materialize``), so no process ever holds the whole model.

Either way the shards are cut from rank 0's values, as DDP starts from rank 0's, so a script
that seeds each rank differently still trains one model.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from functools import cached_property
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from loom import comm
from loom.cluster import ClusterSpec, TorchrunEnvironment
from loom.comm import Connection
from loom.compat import BatchNormBase
from loom.devices import apply_thread_budget, local_device
from loom.errors import ClusterError, LaunchError
from loom.strategies.base import Strategy
from loom.strategies.model_parallel.dtensor_norm import clip_grad_norm
from loom.strategies.model_parallel.fsdp_comms import use_fast_reduce_scatter
from loom.strategies.model_parallel.mesh import broadcast_states
from loom.strategies.precision import DTYPES, Precision
from loom.strategies.data_parallel.sync_batchnorm import GlooSyncBatchNorm, convert_sync_batchnorm

Init = Callable[[nn.Module], None]
OFFLOAD_ON_CPU = "offload=True keeps the shards in CPU memory between uses, but this job already computes on the CPU; drop offload"


def shard_model(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    wrap: Sequence[type[nn.Module]] | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: bool = False,
) -> nn.Module:
    """``fully_shard`` each block of ``module`` (the classes in ``wrap``, else ``blocks(module)``), then the root.

    ``mesh``: the ranks to shard over; a 2-D mesh shards over its last dimension and
    replicates over its first (HSDP). None: every rank of the job. Returns ``module``,
    changed in place (its parameters become DTensor shards). Over gloo, gradients are
    reduce-scattered by all-to-all (``fsdp_comms``), twice as fast as gloo's reduce-scatter.
    """
    device_type = mesh.device_type if mesh is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    if offload and device_type == "cpu":
        raise ValueError(OFFLOAD_ON_CPU)
    targets = blocks(module) if wrap is None else _named_classes(module, wrap)
    policy = mp_policy or MixedPrecisionPolicy()
    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy(),
    }
    inner = replace(policy, output_dtype=None)  # the model's outputs are cast, not every block's
    for norm in _batchnorms_kept_in_fp32(module, targets, policy):
        fully_shard(norm, mp_policy=MixedPrecisionPolicy(reduce_dtype=policy.reduce_dtype), **options)
    for block in reversed(targets):  # inner modules first: FSDP2 groups a block's parameters apart from its parent's
        if block is not module:
            fully_shard(block, mp_policy=inner, **options)
    fully_shard(module, mp_policy=policy, **options)
    group = mesh.get_group(mesh.ndim - 1) if mesh is not None else dist.group.WORLD  # the dimension FSDP shards over
    use_fast_reduce_scatter([*targets, module], group)
    return module


def _batchnorms_kept_in_fp32(module: nn.Module, targets: Sequence[nn.Module], policy: MixedPrecisionPolicy) -> list[nn.Module]:
    """BatchNorm layers to shard as their own units with fp32 weights: torch's batch_norm refuses
    bf16 (fp16) weights beside its fp32 running statistics, and takes low-precision inputs with fp32
    weights (as autocast runs it). loom's own synced BatchNorm computes in any dtype: left as is."""
    if policy.param_dtype in (None, torch.float32):
        return []
    return [
        m for m in module.modules()
        if isinstance(m, BatchNormBase) and not isinstance(m, GlooSyncBatchNorm) and m.track_running_stats and m.affine and all(m is not t for t in [*targets, module])
    ]


def blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``module``: the entries of its biggest ModuleList or Sequential of one class.

    None (a small model without repeated blocks): the root alone is one unit.
    """
    best: list[nn.Module] = []
    best_size = 0
    for child in module.modules():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) > 1:
            entries = list(child)
            if len({type(e) for e in entries}) == 1:
                size = sum(p.numel() for p in child.parameters())
                if size > best_size:
                    best, best_size = entries, size
    return best


def _named_classes(module: nn.Module, wrap: Sequence[type[nn.Module]]) -> list[nn.Module]:
    classes = tuple(wrap)
    if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"wrap takes nn.Module classes, e.g. wrap=[Block], not {list(wrap)!r}")
    found = [m for m in module.modules() if isinstance(m, classes)]
    missing = [c.__name__ for c in classes if not any(isinstance(m, c) for m in found)]
    if missing:
        present = sorted({type(m).__name__ for m in module.modules()})
        raise ValueError(f"wrap names {', '.join(missing)}, but the model has no such module (it has: {', '.join(present)}); name one of those classes")
    return found


def materialize(module: nn.Module, device: torch.device, init: Init | None = None, wire: torch.device | None = None) -> None:
    """Give a model built on the meta device (and already sharded) real values, one module at a time.

    Each module's own parameters are made full-size on the CPU, filled by its
    ``reset_parameters()`` (in the order the modules were registered, which is the order they
    were built in), then by ``init`` applied to every module as ``model.apply(init)`` would,
    and each replica gets its shard of rank 0's values (scattered from there: each rank may
    have been seeded differently), which equal rank 0's model built eagerly on the CPU.
    ``wire``: the device values are sent from (the job's, where ``device`` is the CPU memory
    of offloaded shards); default ``device``.
    """
    wire = wire or device
    module.to_empty(device=device)
    with torch.no_grad():
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                _fill(sub, reset, gather=False, wire=wire)  # what to_empty left is no value to keep
        if init is not None:
            for sub in _post_order(module):
                _fill(sub, lambda sub=sub: init(sub), gather=True, wire=wire)


def check_initialisable(module: nn.Module, init: Init | None) -> None:
    """Without ``init``, a module built on meta whose parameters no ``reset_parameters`` sets would keep garbage."""
    if init is not None:
        return
    for sub in module.modules():
        if next(sub.parameters(recurse=False), None) is not None and not callable(getattr(sub, "reset_parameters", None)):
            raise ValueError(
                f"a model built under strategy.scope() gets its values from reset_parameters(), which {type(sub).__name__} "
                "lacks: give it one, pass scope(init=fn) to initialise every module, or build the model outside scope()"
            )


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _fill(module: nn.Module, fill: Callable[[], Any], gather: bool, wire: torch.device) -> None:
    """Run ``fill`` on full-size CPU stand-ins of ``module``'s own tensors, then keep this replica's shard of each.

    ``gather``: the stand-ins start from the current values, gathered, so that a fill that
    leaves a tensor as it was (``init`` passing over a LayerNorm) keeps it.
    """
    params = dict(module.named_parameters(recurse=False))
    own = {**params, **dict(module.named_buffers(recurse=False))}
    standins = {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).to("cpu", copy=True) if gather else torch.empty(t.shape, dtype=t.dtype)
        for name, t in own.items()
    }
    for name, full in standins.items():
        setattr(module, name, nn.Parameter(full, requires_grad=False) if name in params else full)
    try:
        fill()
    finally:
        for name, tensor in own.items():
            setattr(module, name, tensor)
    for name, tensor in own.items():
        full = standins[name]
        if isinstance(tensor, DTensor):
            full = distribute_tensor(full.to(wire), tensor.device_mesh, tensor.placements, src_data_rank=0).to_local()
            tensor.to_local().copy_(full)
        else:  # a buffer, which FSDP does not shard
            tensor.copy_(comm.broadcast(full.to(wire), 0))


def _onto_shards(optimizer: torch.optim.Optimizer, names: dict[int, str], sharded: dict[str, nn.Parameter]) -> None:
    """Point an optimizer built on a model's parameters at the shards that ``fully_shard`` put in their place."""
    groups = optimizer.param_groups
    if not all(id(p) in names for group in groups for p in group["params"]):
        return  # not this model's: Strategy.prepare says so
    if optimizer.state:
        raise ValueError(
            "the optimizer has already stepped on the unsharded parameters, and its state cannot follow them onto "
            "their shards: pass it to prepare() before its first step, or pass a factory (lambda params: ...)"
        )
    for group in groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]


class ShardedPrecision(Precision):
    """bf16 (and fp16) parameters in forward and backward through FSDP's mixed-precision policy.

    The shards, the gradients they receive and the optimizer stay fp32; the gradients are
    reduced in fp32. No autocast on top: the policy already runs every block in low precision;
    the wrapper only casts the outputs back to fp32, in the model's own containers (FSDP's
    ``output_dtype`` would turn a dict subclass into a dict).
    fp16 keeps torch's GradScaler: DTensor all-reduces its overflow check over the mesh, so an
    inf in one replica's shard skips the step on every replica.
    """

    def autocast(self) -> ContextManager[Any]:
        return nullcontext()


class ShardedStrategy(Strategy):
    """ZeRO-3 on FSDP2: every replica keeps 1/N of the parameters, gradients and optimizer state.

    Use it for a dense model whose parameters, gradients and Adam state (16 bytes a
    parameter in fp32) do not fit in one device's memory. Same loop, same results as
    MirroredStrategy; the price is each block's all-gather in forward and again in backward,
    and a reduce-scatter, where Mirrored has one all-reduce overlapped with backward. On CPU
    processes over gloo (bench/sharded.py, 2 processes) it ran at 0.42x Mirrored's
    throughput, 0.71x with ``reshard_after_forward=False``, which saves the second all-gather
    for more memory: with every core computing nothing overlaps, and a step cost 2.4x
    Mirrored's CPU time (1.4x without the second all-gather).

    Args:
        wrap: module classes that are each one unit of sharding, e.g. ``wrap=[Block]``;
            default: the entries of the model's biggest list of repeated blocks
            (``loom.strategies.model_parallel.sharded.blocks``).
        reshard_after_forward: free each block's gathered parameters after its forward
            (gather again for backward); False keeps them until backward: faster, more memory.
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``: parameters cast to bf16
            (fp16) for forward and backward by FSDP's mixed-precision policy, gradients
            reduced and kept in fp32 (fp16 with a gradient scaler whose overflow check covers
            every rank).
        mp_policy: an explicit ``torch.distributed.fsdp.MixedPrecisionPolicy`` instead.
        offload: keep shards, gradients and optimizer state in CPU memory (GPU jobs only).
        num_replicas, timeout, backend: as for MirroredStrategy.
        sync_batchnorm: BatchNorm layers compute their statistics over the global batch (as
            MirroredStrategy's); otherwise each replica over its own slice.
    """

    def __init__(
        self,
        wrap: Sequence[type[nn.Module]] | None = None,
        reshard_after_forward: bool = True,
        precision: str = "32",
        mp_policy: MixedPrecisionPolicy | None = None,
        offload: bool = False,
        num_replicas: int | None = None,
        timeout: float | None = None,
        backend: str | None = None,
        sync_batchnorm: bool = False,
    ) -> None:
        super().__init__(precision=precision, timeout=timeout)
        self.sync_batchnorm = sync_batchnorm
        if not TorchrunEnvironment.detect():
            raise LaunchError(
                "ShardedStrategy runs one process per replica: start the script with `loom run script.py` or call loom.launch(main) in it"
            )
        self.cluster: ClusterSpec = TorchrunEnvironment.resolve()
        if num_replicas is not None and num_replicas != self.cluster.world_size:
            raise ClusterError(
                f"ShardedStrategy(num_replicas={num_replicas}) but the job has {self.cluster.world_size} process(es); "
                f"launch it with {num_replicas} processes or drop num_replicas"
            )
        if precision not in DTYPES:
            raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(repr(p) for p in DTYPES)}")
        self._device = local_device(self.cluster.local_rank)
        if offload and self._device.type == "cpu":
            raise ValueError(OFFLOAD_ON_CPU)
        self.wrap = wrap
        self.reshard_after_forward = reshard_after_forward
        low = DTYPES[precision]
        self.mp_policy = mp_policy or MixedPrecisionPolicy(  # the outputs are cast by the precision's wrapper, keeping their class
            param_dtype=low, reduce_dtype=torch.float32 if low else None
        )
        self.offload = offload
        self.threads = apply_thread_budget(self.cluster.local_world_size) if self._device.type == "cpu" else None
        self._connection = Connection.join(self.cluster, self._device, self.timeout, backend)
        self._mesh: DeviceMesh = init_device_mesh(self._device.type, (self.cluster.world_size,), mesh_dim_names=("dp_shard",))
        self._sharded: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # every model prepared, while it lives
        self._init: Init | None = None

    @property
    def num_replicas_in_sync(self) -> int:
        return self.cluster.world_size

    @property
    def replica_id(self) -> int:
        return self.cluster.rank

    @property
    def device(self) -> torch.device:
        return self._device

    @cached_property
    def precision(self) -> Precision:
        return ShardedPrecision(self._precision_name, self._device)

    @contextmanager
    def scope(self, init: Init | None = None) -> Iterator[None]:
        """Build the model inside: it is made on the meta device, and ``prepare`` gives each replica only its shards.

        Its initial values come from every module's ``reset_parameters()``, then from
        ``init`` applied to every module (as ``model.apply(init)`` in the constructor, e.g.
        ``scope(init=GPT._init)``), drawn on the CPU from torch's generator: seeded the same,
        they equal the model built eagerly. Other values set in a constructor (a buffer
        computed there) are not kept: give such a module a ``reset_parameters``.
        """
        self._init = init
        with torch.device("meta"):
            yield

    def prepare(self, model: nn.Module, optimizer: Any = None, *, fast_path: bool | Sequence[str] | None = None, example_input: Any = None) -> Any:  # type: ignore[override]
        """As ``Strategy.prepare``; an optimizer built on the model's parameters before is moved onto their shards."""
        self._fast_path_for_parts(fast_path)
        if isinstance(model, nn.Module) and not isinstance(model, FSDPModule):
            if self.sync_batchnorm:  # before sharding: the synced layers keep the very parameters
                model = convert_sync_batchnorm(model, self._device)
            names = {id(p): name for name, p in model.named_parameters()}
            on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
            if on_meta:
                check_initialisable(model, self._init)
            with self._guard():
                if not on_meta:
                    broadcast_states(model, self._device)  # the shards are cut from rank 0's model
                shard_model(
                    model, self._mesh, wrap=self.wrap, reshard_after_forward=self.reshard_after_forward,
                    mp_policy=self.mp_policy, offload=self.offload,
                )  # fmt: skip
                if on_meta:
                    materialize(model, torch.device("cpu") if self.offload else self._device, self._init, self._device)
            self._sharded.add(model)
            if isinstance(optimizer, torch.optim.Optimizer):
                _onto_shards(optimizer, names, dict(model.named_parameters()))
        with self._placed_on_cpu() if self.offload else nullcontext():
            return super().prepare(model, optimizer)

    @contextmanager
    def _placed_on_cpu(self) -> Iterator[None]:
        """``Strategy.prepare`` moves the model to ``device``; offloaded shards stay in CPU memory."""
        device, self._device = self._device, torch.device("cpu")
        try:
            yield
        finally:
            self._device = device

    def _set_gradient_sync(self, enabled: bool) -> None:
        for module in self._sharded:
            module.set_requires_gradient_sync(enabled)

    def _clip_grad_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        with self._guard():
            return clip_grad_norm(params, max_norm, norm_type)
