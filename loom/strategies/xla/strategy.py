"""TPUStrategy: the same script on XLA devices (TPUs, or XLA's CPU devices), through one compiled step.

Built on torchax (PyTorch on JAX) and JAX's PJRT runtime; JAX and torchax are imported when
the strategy is created, never by ``import loom``. One process per host drives all of its
devices: the replicas are the devices of the mesh's ``data`` axis, and ``train_step`` is a
single ``jax.jit`` program (``step.py``). There is no eager backward: gradients come from JAX.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from loom.data import DistributedLoader, Pipeline
from loom.data.sharding import check_global_batch
from loom.strategies.base import Strategy, unwrap
from loom.strategies.precision import canonical
from loom.strategies.step import LossFn
from loom.strategies.xla import feed, runtime
from loom.strategies.xla.hosts import Hosts
from loom.strategies.xla.mesh import build_mesh
from loom.strategies.xla.state import DeviceState
from loom.strategies.xla.tree import leaves, map_tensors

BACKWARD = (
    "TPUStrategy compiles forward, backward and the update into one XLA program, so there is no eager "
    "backward: use step = strategy.train_step(model, loss_fn, opt) and loss = step(x, y), or loom.fit"
)


class TPUStrategy(Strategy):
    """Every XLA device JAX sees, as a mesh; the batch split over ``data``, large weights over ``model``.

    Args:
        mesh: axis sizes, ``{"data": N}`` (default: every device) or ``{"data": 4, "model": 2}``.
        precision: ``"32"`` or ``"bf16-mixed"`` (the forward in bfloat16, fp32 parameters,
            outputs and loss). ``"16-mixed"`` is refused: XLA devices run bfloat16.
        shard_threshold: parameters with at least this many elements are split over the
            ``model`` axis (along their largest dimension it divides); smaller ones are replicated.
        seed: of the random numbers the compiled step draws (dropout).
        timeout: accepted for the common signature; XLA's collectives live inside the program.
    """

    def __init__(self, mesh: dict[str, int] | None = None, precision: str = "32", shard_threshold: int = 1 << 16,
                 seed: int = 0, timeout: float | None = None) -> None:  # fmt: skip
        if canonical(precision) == "16-mixed":
            raise ValueError("TPUStrategy runs mixed precision in bfloat16 (no loss scaling on XLA): use precision='bf16-mixed'")
        super().__init__(precision=precision, timeout=timeout)
        self._jax = runtime.require()
        self.plan = build_mesh(self._jax, mesh, shard_threshold)
        self._states: weakref.WeakKeyDictionary[nn.Module, DeviceState] = weakref.WeakKeyDictionary()
        self._key = self._jax.random.key(seed)
        self._hosts = Hosts(self._jax)

    # ---- topology: TF's replicas are the data axis's devices; one process per host feeds them
    @property
    def num_replicas_in_sync(self) -> int:
        """Devices on the mesh's ``data`` axis, as in TF: ``per_replica_batch * num_replicas_in_sync`` is the global batch."""
        return self.plan.data_size

    @property
    def data_parallel_size(self) -> int:
        """Devices on the mesh's ``data`` axis: each computes the gradient of its slice of the batch."""
        return self.plan.data_size

    @property
    def num_hosts(self) -> int:
        """Processes (one per host) feeding the step: each reads its host's share of every global batch."""
        return self._jax.process_count()

    @property
    def host_id(self) -> int:
        """This host's index, 0 .. num_hosts - 1; 0 on one machine."""
        return self._jax.process_index()

    @property
    def replica_id(self) -> int:
        """The first replica (data device) this host drives; host 0 drives replica 0."""
        return self.host_id * (self.data_parallel_size // self.num_hosts)

    @property
    def device(self) -> torch.device:
        """Batches arrive as host tensors; their device copies are made by ``distribute``."""
        return torch.device("cpu")

    @property
    def mesh(self) -> Any:
        return self.plan.mesh

    def prepare(self, model: nn.Module, optimizer: Any = None, *, fast_path: bool | Sequence[str] | None = None, example_input: Any = None) -> Any:  # type: ignore[override]
        """As ``Strategy.prepare``; the eager fast path does not apply to the compiled step."""
        self._fast_path_for_parts(fast_path, "XLA compiles every step already, and the trial times the eager model")
        return super().prepare(model, optimizer)

    # ---- the step -----------------------------------------------------------------------------
    def device_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> DeviceState:
        """The devices' copy of ``model`` (unwrapped) and its optimizer's state, one per model."""
        module = unwrap(model)
        state = self._states.get(module)
        if state is None:
            state = self._states[module] = DeviceState(module, optimizer, self.plan)
            if model is not module:  # the wrapper prepare returned reads the same parameters
                state.watch(model)
        elif state.optimizer is not optimizer:
            raise ValueError("TPUStrategy trains a model with one optimizer: build one train_step per model")
        return state

    def train_step(self, model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                   max_grad_norm: float | None = None, accumulate: int = 1) -> Any:  # fmt: skip
        """One XLA program per call: forward, loss, gradients, their all-reduce, clipping and the update."""
        from loom.strategies.xla.step import XLATrainStep

        return XLATrainStep(self, model, loss_fn, optimizer, scheduler, max_grad_norm, accumulate)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        raise RuntimeError(BACKWARD)

    def accumulate(self, steps: int) -> Any:  # type: ignore[override]
        """Refused when called: there is no eager backward to accumulate over."""
        raise RuntimeError(
            "TPUStrategy compiles forward, backward and the update into one XLA program, so there is no eager loop for "
            "accumulate() to count: pass accumulate=k to strategy.train_step(model, loss_fn, opt, accumulate=k) or to loom.fit"
        )

    def next_key(self) -> Any:
        self._key, key = self._jax.random.split(self._key)
        return key

    def to_device(self, batch: Any) -> Any:
        """A global batch's tensors as arrays split over ``data`` (the copies ``distribute`` started, if any)."""
        if batch is None:
            return None
        sharding = self.plan.batch()
        local = self.plan.data_size // self.num_hosts

        def put(t: torch.Tensor) -> Any:
            copy = feed.attached(t)
            if copy is not None:
                return copy
            if t.dim() == 0 or t.shape[0] % local:
                raise ValueError(
                    f"TPUStrategy splits every batch over {local} devices, and this one has {t.shape[0] if t.dim() else 0} "
                    f"samples: pass batches from strategy.distribute, or a multiple of {local}"
                )
            return feed.device_array(t, sharding)

        if not all(isinstance(t, torch.Tensor) for t in leaves(batch)):
            raise TypeError("TPUStrategy's step takes tensors, or lists, tuples and dicts of them, as inputs and targets")
        return map_tensors(put, batch)

    # ---- data ---------------------------------------------------------------------------------
    def distribute(self, data: Dataset | DataLoader | Pipeline | Iterable[Any], batch_size: int | None = None,
                   shuffle: bool | None = None, seed: int = 0, drop_last: bool | None = None, num_workers: int | None = None,
                   collate_fn: Callable[[list[Any]], Any] | None = None, shard_by: str = "auto") -> feed.DeviceLoader:  # fmt: skip
        """Global batches split over the ``data`` axis, the next one copied while a step runs.

        Each host reads its part with loom's loader (same order, seeds, resumable position);
        ``batch_size`` must split evenly over the data devices. The uneven last batch is padded
        as under every strategy; ``valid_count(k)`` says how many of batch k's samples are real.
        """
        hosts, host = self.num_hosts, self.host_id
        if isinstance(data, Pipeline):
            inner = data.loader(hosts, host, self.device, batch_size, shard_by)
        else:
            inner = DistributedLoader(data, batch_size, hosts, host, self.device, shuffle=shuffle, seed=seed,
                                      drop_last=drop_last, num_workers=num_workers, collate_fn=collate_fn)  # fmt: skip
        check_global_batch(inner.global_batch, self.data_parallel_size)
        sharding = self.plan.batch()
        return feed.DeviceLoader(inner, self.data_parallel_size // hosts, lambda t: feed.device_array(t, sharding))

    def distribute_datasets_from_function(self, dataset_fn: Callable[..., Any], options: Any = None) -> Any:
        """Refused: one pipeline per host feeds all of its devices."""
        raise NotImplementedError(
            "TPUStrategy feeds all of a host's devices from one pipeline: use strategy.distribute(dataset, "
            "batch_size=GLOBAL_BATCH) instead of distribute_datasets_from_function"
        )

    # ---- values across hosts: each host's value covers its devices' samples ------------------
    def _transport(self) -> Hosts:
        return self._hosts

    def barrier(self) -> None:
        self._hosts.barrier()

    # ---- checkpoints: the devices' values, as the ordinary checkpoint of the user's objects --
    def save(self, directory: str | Path, **kwargs: Any) -> Path:
        self._one_host("save")
        for state in list(self._states.values()):
            state.download()
        return super().save(directory, **kwargs)

    def restore(self, directory: str | Path, **kwargs: Any) -> dict[str, Any] | None:
        self._one_host("restore")
        restored = super().restore(directory, **kwargs)
        for state in list(self._states.values()):
            state.mark_host_newer()
        return restored

    def _one_host(self, what: str) -> None:
        if self._jax.process_count() > 1:
            raise NotImplementedError(f"TPUStrategy.{what}() runs on one host; a job over {self._jax.process_count()} hosts cannot {what} yet")
