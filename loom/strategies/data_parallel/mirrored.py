"""Synchronous data parallelism: a replica per process, gradients all-reduced in every step.

Built on DistributedDataParallel, which buckets gradients and overlaps their all-reduce with
the rest of the backward pass. How the bytes travel (plain, fp16/bf16, PowerSGD, or chosen
from the measured link) is an argument, kept in ``loom.comm.compression``.
"""

from __future__ import annotations

import re
import weakref
from contextlib import ExitStack
from collections.abc import Iterable
from typing import Any, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from loom import comm
from loom.cluster import ClusterSpec, TorchrunEnvironment
from loom.comm import Connection
from loom.compat import DDP_BUFFER_SYNC, ddp_backward_syncs, ddp_syncs_buffers, lay_out_ddp_buckets, set_ddp_backward_sync
from loom.comm.compression import Compression, PowerSGD, check_compression, choose_compression, compression_hook, measure_bandwidth
from loom.devices import apply_thread_budget, local_device
from loom.errors import ClusterError, LaunchError
from loom.strategies.base import Strategy, unwrap
from loom.strategies.data_parallel.sync_batchnorm import convert_sync_batchnorm, refuse_torch_sync_batchnorm


class MirroredStrategy(Strategy):
    """All local devices of one machine: every GPU, or on a CPU-only machine N processes.

    Args:
        num_replicas: expected number of replicas; an error if the launch disagrees.
        compression: ``None``, ``"fp16"``, ``"bf16"``, ``"powersgd"`` (or ``loom.comm.PowerSGD(rank=...,
            error_feedback=...)``) all-reduce of gradients; ``"auto"`` measures the link when a model is
            prepared and picks the lightest that fits a step (``loom.comm.compression.choose_compression``).
        bucket_cap_mb: DDP bucket size; ``"auto"`` (the default) cuts the model's gradients into about
            ``AUTO_BUCKETS`` buckets of 1-25 MB, so the first all-reduce starts early in the backward pass
            and the last one, which nothing overlaps, is short.
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``.
        timeout: seconds a collective may wait before the job fails naming the missing rank
            (default: ``LOOM_TIMEOUT``, else 300).
        backend: ``"gloo"`` or ``"nccl"``; default from the device.
        find_unused_parameters: DDP's option for models with parameters that some steps do not
            use (a branch not taken, a frozen head); costs a graph walk per step.
        static_graph: DDP's option for a graph that is the same every step (lets it skip
            that walk, and allows reentrant activation checkpointing).
        broadcast_buffers: DDP's option (``forward_sync_buffers`` from torch 2.13): replica 0's
            buffers (BatchNorm statistics) copied to every replica before each forward; they are
            made equal once at the start either way.
        sync_batchnorm: BatchNorm layers compute their statistics over the global batch.
    """

    def __init__(
        self,
        num_replicas: int | None = None,
        compression: Compression = None,
        bucket_cap_mb: float | str = "auto",
        precision: str = "32",
        timeout: float | None = None,
        backend: str | None = None,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        broadcast_buffers: bool = True,
        sync_batchnorm: bool = False,
    ) -> None:
        super().__init__(precision=precision, timeout=timeout)
        check_compression(compression)
        if bucket_cap_mb != "auto" and not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a positive number of MB or 'auto', got {bucket_cap_mb!r}")
        if not TorchrunEnvironment.detect():
            raise LaunchError(
                f"{type(self).__name__} runs one process per replica: start the script with "
                "`loom run script.py` or call loom.launch(main) in it"
            )
        self.cluster: ClusterSpec = TorchrunEnvironment.resolve()
        self._check_topology(num_replicas)
        self.compression = compression
        self.bucket_cap_mb = bucket_cap_mb
        self._bandwidth: float | None = None  # measured once, for compression="auto"
        self.ddp_options = {
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            DDP_BUFFER_SYNC: broadcast_buffers,
        }
        self.sync_batchnorm = sync_batchnorm
        self._device = local_device(self.cluster.local_rank)
        self.threads = apply_thread_budget(self.cluster.local_world_size) if self._device.type == "cpu" else None
        self._ddp: weakref.WeakSet[ReplicatedModule] = weakref.WeakSet()  # every model prepared, while it lives
        self._connection = Connection.join(self.cluster, self._device, self.timeout, backend)

    def _check_topology(self, num_replicas: int | None) -> None:
        world = self.cluster.world_size
        if num_replicas is not None and num_replicas != world:
            raise ClusterError(
                f"{type(self).__name__}(num_replicas={num_replicas}) but the job has {world} process(es); "
                f"launch it with {num_replicas} processes or drop num_replicas"
            )
        if self.cluster.nnodes > 1:
            raise ClusterError(
                f"MirroredStrategy is for one machine but this job spans {self.cluster.nnodes} nodes; "
                "use MultiWorkerMirroredStrategy"
            )

    @property
    def num_replicas_in_sync(self) -> int:
        return self.cluster.world_size

    @property
    def replica_id(self) -> int:
        return self.cluster.rank

    @property
    def device(self) -> torch.device:
        return self._device

    def _wrap_model(self, module: nn.Module) -> nn.Module:
        if self.sync_batchnorm:  # torch's SyncBatchNorm layers too: on CPU they become loom's
            module = convert_sync_batchnorm(module, self._device)
        refuse_torch_sync_batchnorm(module, self._device, type(self).__name__)
        shapes = [p.shape for p in module.parameters() if p.requires_grad]
        compression = self._resolve_compression(shapes)
        ddp = ReplicatedModule(
            module,
            device_ids=[self._device] if self._device.type == "cuda" else None,
            bucket_cap_mb=self._bucket_cap_mb(shapes, compression),
            gradient_as_bucket_view=True,
            **self.ddp_options,
        )
        hook = compression_hook(compression)
        if hook is not None:
            ddp.register_comm_hook(hook[1], hook[0])
        self._ddp.add(ddp)
        return ddp

    def _bucket_cap_mb(self, shapes: list[torch.Size], compression: Compression) -> float:
        """PowerSGD's hook finishes each bucket's collectives before backward goes on, so for it more
        buckets add only round trips: "auto" gives it one. Otherwise "auto" sizes buckets for overlap."""
        if self.bucket_cap_mb != "auto":
            return self.bucket_cap_mb
        if compression == "powersgd" or isinstance(compression, PowerSGD):
            return sum(int(s.numel()) for s in shapes) * 4 / 2**20 + 1.0
        return auto_bucket_cap_mb(shapes)

    def _resolve_compression(self, shapes: list[torch.Size]) -> Compression:
        """The compression for a model with these gradients; "auto" measures the link once and says what it picked."""
        if self.compression != "auto":
            return self.compression
        if self._bandwidth is None:
            self._bandwidth = measure_bandwidth()
        choice = choose_compression(shapes, self._bandwidth, self.num_replicas_in_sync)
        self.print(choice.line)
        return choice.name

    def _skip_gradient_sync(self) -> ContextManager[Any]:
        stack = ExitStack()
        for ddp in self._ddp:
            if ddp.may_skip_sync:
                stack.enter_context(ddp.no_sync())
        return stack

    def _set_gradient_sync(self, enabled: bool) -> None:
        for ddp in self._ddp:
            set_ddp_backward_sync(ddp, enabled or not ddp.may_skip_sync)

    def save(self, directory: Any, **options: Any) -> Any:  # type: ignore[override]
        """DDP hands every replica replica 0's buffers (BatchNorm statistics) at the next forward;
        the checkpoint holds those too, so a resumed run equals one that went on."""
        with self._guard():
            for ddp in self._replicated_in(options.values()):
                if ddp_syncs_buffers(ddp):
                    for buffer in ddp.module.buffers():
                        comm.broadcast(buffer, 0)
        return super().save(directory, **options)

    def _replicated_in(self, items: Iterable[Any]) -> list[ReplicatedModule]:
        """The prepared models among ``items`` or inside them (wrapped or not), in the items' order.

        Not every model prepared that still lives: a process's garbage collector decides when a
        dropped one goes, so another process may hold a different set, and its collectives would
        not match."""
        ours = {}
        for ddp in self._ddp:  # the wrapper, the module it wraps (maybe compiled) and the user's own module
            ours[id(ddp)] = ours[id(ddp.module)] = ours[id(unwrap(ddp))] = ddp
        found: list[ReplicatedModule] = []
        for item in items:
            for module in item.modules() if isinstance(item, nn.Module) else ():
                ddp = ours.get(id(module))
                if ddp is not None and not any(ddp is f for f in found):
                    found.append(ddp)
        return found


AUTO_BUCKETS = 8


def auto_bucket_cap_mb(shapes: list[torch.Size], element_size: int = 4) -> float:
    """A bucket size that splits these gradients into about ``AUTO_BUCKETS`` all-reduces, within 1-25 MB.

    DDP's fixed 25 MB puts most of a 38 MB MLP in one bucket that is ready only near the end of
    the backward pass, so the link idles while the gradients are computed and then works alone.
    """
    total = sum(int(s.numel()) for s in shapes) * element_size / 2**20
    return min(25.0, max(1.0, total / AUTO_BUCKETS))


class ReplicatedModule(DistributedDataParallel):
    """DDP with its gradient buckets laid out once, when it is made, and its unused-parameter error in one line.

    DDP lays its buckets out again after the first backward, in the order the gradients came. A
    job restarted from a checkpoint took its first step in the first layout, where a gradient
    sits elsewhere in the all-reduced buffer, so in another chunk of the ring: over three or more
    replicas its sum was added up in another order, and the resumed run ended 1e-7 off. Here the
    layout is made at once, from the parameters in reverse order (the order DDP assumes their
    gradients come in: the last layers' first, so the first bucket's all-reduce overlaps the
    rest of the backward pass), and every step of every run reduces alike.
    """

    synced_once = False  # a static graph is recorded in a synchronised backward: none may be skipped before

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        lay_out_ddp_buckets(self)  # as if a backward had handed every gradient, in reverse order: for good (a no-op with find_unused_parameters)

    def _build_params_for_reducer(self) -> tuple[list[nn.Parameter], list[bool]]:
        """The parameters in reverse order, so the layout made from them puts the last layers' in the first bucket."""
        parameters, sparse = super()._build_params_for_reducer()
        return parameters[::-1], sparse[::-1]

    @property
    def may_skip_sync(self) -> bool:
        return self.synced_once or not self.static_graph

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if ddp_backward_syncs(self) and torch.is_grad_enabled():
            self.synced_once = True
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as error:
            if "Expected to have finished reduction" not in str(error) or self.find_unused_parameters:
                raise
            raise RuntimeError(self._unused_message(str(error))) from None

    def _unused_message(self, error: str) -> str:
        names = [n.replace("_orig_mod.", "") for n, p in self.module.named_parameters() if p.requires_grad and n not in self.parameters_to_ignore]
        found = re.search(r"did not receive grad for rank \d+: ([\d ,]+)", error)
        indices = sorted(len(names) - 1 - int(i) for i in re.findall(r"\d+", found.group(1)) if int(i) < len(names)) if found else []
        unused = [names[i] for i in indices]  # DDP counts the parameters in reverse (_build_params_for_reducer)
        which = f"parameter(s) {', '.join(unused)}" if unused else "some parameters"
        return (
            f"{which} got no gradient in the previous step (not used to compute the loss), which DDP cannot "
            "sync by default: pass find_unused_parameters=True to the strategy, "
            "or freeze them with requires_grad_(False)"
        )


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """MirroredStrategy over several machines: every replica on every node, one all-reduce.

    The cluster comes from the launcher (``loom run --nnodes``, TF_CONFIG or Slurm).
    """

    def _check_topology(self, num_replicas: int | None) -> None:
        if num_replicas is not None and num_replicas != self.cluster.world_size:
            super()._check_topology(num_replicas)
