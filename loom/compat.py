"""Every private name of PyTorch, torchft (and CPython) that loom relies on, in one place.

Each stands in for something the public API lacks. ``tests/test_compat.py`` checks every one
against the installed versions, so an upgrade that renames or reshapes one fails there, by
name, rather than deep inside a job.
"""

from __future__ import annotations

import atexit
import importlib.machinery
import os
import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm as BatchNormBase  # noqa: F401 - every BatchNorm*d and SyncBatchNorm

if TYPE_CHECKING:  # DCP (and DTensor under it) costs a second of CPU to import: launchers never need it
    from torch.distributed.checkpoint import FileSystemReader

# What DCP's index (``.metadata``, a pickle) is made of: the allow-list of loom's unpickler.
# Three of these names are private to torch; an index written by another torch may use others.
# BytesStorageMetadata is never written by loom; it is let through so that the index check
# (``loom.checkpoint.safe_reader``) can refuse it naming its key.
DCP_INDEX_CLASSES: dict[str, set[str]] = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a name-to-layout lookup
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


def dcp_index_path(reader: FileSystemReader, rank: int | None = None) -> os.PathLike:
    """The file DCP's reader reads its index from (``.metadata``)."""
    return reader._get_metadata_path(rank)


def dcp_storage_info() -> type:
    """The class of a DCP index's storage entries (``_StorageInfo``: a file, an offset, a length)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """DCP's ``get_optimizer_state_dict``, leaving an optimizer without state as it was.

    For an optimizer with no state yet (before its first step), DCP's private
    ``_init_optim_state`` creates one by a step at learning rate 0: Adam's step count becomes
    1 and every later update differs. It skips that step when a parameter has a gradient, so
    one is lent a zero gradient meanwhile; there is no state to save then, only hyper-parameters.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    params = [p for group in optimizer.param_groups for p in group["params"]]
    lent = next((p for p in params if p.requires_grad), None)  # none: DCP's step would change nothing
    if optimizer.state or lent is None or any(p.grad is not None for p in params):
        return get_optimizer_state_dict(model, optimizer)
    lent.grad = torch.zeros_like(lent)
    try:
        return get_optimizer_state_dict(model, optimizer)
    finally:
        lent.grad = None


def compiled_module_type() -> type[nn.Module] | None:
    """The class ``torch.compile(module)`` returns, once torch.compile has been used in this process.

    Importing ``torch._dynamo`` costs 1.3 s of CPU, in every process; a module compiled here
    has already imported it, so loom looks only.
    """
    return getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)


def compiled_original(compiled: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, from its wrapper (``OptimizedModule._orig_mod``, torch 2.13.0)."""
    return compiled._orig_mod


def child_names(module: nn.Module) -> list[str]:
    """Every name a submodule is registered under in ``module``, in order, a shared or None one
    included (``named_children`` leaves those out): ``Module._modules``, torch 2.13.0."""
    return list(module._modules)


def compile_like(compiled: nn.Module, module: nn.Module) -> None:
    """Compile ``module`` in place, as ``Module.compile`` does, with the backend and options that
    made ``compiled`` (a ``torch.compile(m)``): its ``dynamo_ctx`` is torch.compile's settings."""
    module._compiled_call_impl = compiled.dynamo_ctx(module._call_impl)


def default_store() -> dist.Store:
    """The key-value store the default process group was made with (torch has no public getter)."""
    return dist.distributed_c10d._get_default_store()


def run_exit_handlers() -> None:
    """Run and clear the atexit handlers now, as the interpreter does at exit."""
    atexit._run_exitfuncs()


def run_torchrun(argv: list[str]) -> Any:
    """torchrun's own command line, run in this process (``torch.distributed.run``'s ``main`` exits)."""
    from torch.distributed import run as torchrun  # torch's elastic agent: imported by launchers only

    return torchrun.run(torchrun.parse_args(argv))


def torchrun_accepts(option: str) -> bool:
    """Whether this torch's torchrun takes ``option`` (older ones lack ``--shutdown-timeout``)."""
    from torch.distributed import run as torchrun

    return any(option in action.option_strings for action in torchrun.get_args_parser()._actions)


# The elastic agent's methods ``loom.launch.agent.ReportingAgent`` extends (private to torch).
AGENT_HOOKS = ("_rendezvous", "_monitor_workers", "_restart_workers")


@contextmanager
def elastic_agent(build: Callable[..., Any]) -> Iterator[None]:
    """torchrun, run in this block, builds its agent with ``build`` (it looks the class up by name)."""
    import torch.distributed.launcher.api as launcher_api  # imported by launchers only

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = build
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original


@contextmanager
def worker_handlers(handler: Callable[..., Any]) -> Iterator[None]:
    """torch's agent, run in this block, wraps each worker process it starts in ``handler``, a
    ``SubprocessHandler`` subclass (torch 2.13 makes them with ``api.get_subprocess_handler``)."""
    import torch.distributed.elastic.multiprocessing.api as api  # imported by launchers only

    original = api.get_subprocess_handler
    api.get_subprocess_handler = handler
    try:
        yield
    finally:
        api.get_subprocess_handler = original


def flight_recorder_entries() -> list[dict[str, Any]]:
    """torch's flight recorder: each process group's recent collectives, oldest first.

    Each entry has ``pg_id``, ``collective_seq_id``, ``profiling_name`` (``gloo:all_reduce``),
    ``input_sizes``, ``input_dtypes``, ``time_created_ns``, ``thread_id`` and ``retired``, not
    the stacks (making frames of those imports torch's compiler). Empty unless
    ``TORCH_FR_BUFFER_SIZE`` was set before this process's first collective.
    """
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace

    return pickle.loads(_dump_fr_trace(True, False, False)).get("entries", [])  # torch's own bytes, made in this process


def start_checkpoint_process(rank: int, world_size: int, local_rank: int, addr: str, port: int) -> None:
    """Start DCP's checkpoint process (``async_save(..., async_checkpointer_type=PROCESS)``)
    with its process group on ``addr:port``, unless this process has one already.

    DCP starts it itself only when the job has a process group, choosing the port by a
    collective; loom starts it also for one process without a group, on a port it agreed on.
    The process is spawned, and a spawned child runs the parent's main script again unless
    the script guards itself with ``if __name__ == "__main__"``: this one needs nothing from
    it, so it is started as if the parent ran ``-m __main__``, which the child skips. Blocks
    until the process has joined its group; call it from the training thread.
    """
    from torch.distributed.checkpoint import _async_process_executor as executor  # spawns, when used

    if executor._CHECKPOINT_PROCESS is not None:
        return
    info = executor._ProcessGroupInitInfo.__new__(executor._ProcessGroupInitInfo)  # its __init__ runs a collective
    info.local_rank, info.global_rank, info.world_size = local_rank, rank, world_size
    info.tcp_store_master_addr, info.tcp_store_master_port = addr, port
    info.use_prefix_store = info.disable_automatic_gc = info.disable_manual_gc = False
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    main.__spec__ = importlib.machinery.ModuleSpec("__main__", None)  # multiprocessing.spawn skips a main named so
    try:
        executor._CHECKPOINT_PROCESS = executor._AsyncCheckpointProcess(info)
    finally:
        main.__spec__ = spec


def checkpoint_process() -> Any:
    """DCP's checkpoint process of this process (a ``multiprocessing.Process``), or None."""
    executor = sys.modules.get("torch.distributed.checkpoint._async_process_executor")
    running = getattr(executor, "_CHECKPOINT_PROCESS", None)
    return running._save_process if running is not None else None


def stop_checkpoint_process(timeout: float = 10.0) -> None:
    """Ask DCP's checkpoint process to leave its group and exit; kill it after ``timeout`` seconds."""
    executor = sys.modules.get("torch.distributed.checkpoint._async_process_executor")
    running = getattr(executor, "_CHECKPOINT_PROCESS", None)
    if running is None:
        return
    executor._CHECKPOINT_PROCESS = None
    process = running._save_process
    if process.is_alive():
        try:
            running._send(executor._CheckpointSaveProcessControlOpts.TERMINATE)
        except OSError:
            pass  # it is already gone
        process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(timeout)


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many tensors, storages and NumPy arrays of this process hold ``storage``'s memory."""
    return torch._C._storage_Use_Count(storage._cdata)


def collate_stacking(batch: list[Any], stack: Callable[..., torch.Tensor]) -> Any:
    """``default_collate`` with its tensors stacked by ``stack`` (torch's ``collate_fn_map`` hook)."""
    from torch.utils.data._utils.collate import collate, default_collate_fn_map

    return collate(batch, collate_fn_map={**default_collate_fn_map, torch.Tensor: stack})


def worker_failure(where: str) -> Any:
    """The exception being handled, in the form a DataLoader worker sends it: picklable whatever
    the exception, and re-raised in the training process with the worker's traceback."""
    from torch._utils import ExceptionWrapper

    return ExceptionWrapper(where=where)


def dead_dataloader_workers(iterator: Any) -> list[int]:
    """Process ids of a DataLoader iterator's workers that have exited. torch looks only after
    5 s with no result, and a live worker's idle tasks keep results coming."""
    return [worker.pid for worker in getattr(iterator, "_workers", []) if not worker.is_alive()]


def pinned(data: Any) -> Any:
    """``data`` (tensors, or lists, tuples and dicts of them) with its CPU tensors in pinned
    memory; a map's tensors already on the device stay as they are."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.pin_memory() if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t, data)


def global_module_hooks() -> bool:
    """Whether hooks registered for every module (``nn.modules.module.register_module_*_hook``) exist."""
    from torch.nn.modules import module

    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks")
    return any(getattr(module, name, None) for name in names)


def _ddp_takes(option: str) -> bool:
    import inspect

    return option in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters


# DDP's option that hands replica 0's buffers to every replica at each forward: torch 2.13
# renamed ``broadcast_buffers`` (now deprecated there) to ``forward_sync_buffers``.
DDP_BUFFER_SYNC = "forward_sync_buffers" if _ddp_takes("forward_sync_buffers") else "broadcast_buffers"


def ddp_syncs_buffers(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Whether ``ddp`` hands replica 0's buffers to every replica, under either torch's name."""
    return bool(getattr(ddp, DDP_BUFFER_SYNC))


# ---- checked against torch 2.13.0 (each has its check in tests/test_compat.py) -------------------
def ddp_backward_syncs(ddp: nn.parallel.DistributedDataParallel) -> bool:
    """Whether ``ddp``'s next backward all-reduces (DDP's ``require_backward_grad_sync``)."""
    return bool(ddp.require_backward_grad_sync)


def set_ddp_backward_sync(ddp: nn.parallel.DistributedDataParallel, enabled: bool) -> None:
    """Have ``ddp``'s next backward all-reduce or accumulate locally, as ``no_sync()`` does inside its
    block; decided before the forward pass (DDP reads it there). Torch 2.13.0."""
    ddp.require_backward_grad_sync = enabled


def lay_out_ddp_buckets(ddp: nn.parallel.DistributedDataParallel) -> None:
    """Make ``ddp``'s gradient bucket layout now, as its first backward would (torch 2.13.0's reducer)."""
    ddp.reducer._push_all_rebuilt_params()
    ddp.reducer._rebuild_buckets()


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers that stay out of its state dict (torch 2.13.0)."""
    return set(module._non_persistent_buffers_set)


def swap_class(module: nn.Module, cls: type[nn.Module]) -> None:
    """Give ``module`` the class ``cls`` in place: a subclass of its class that adds a ``forward`` and
    no state, or back. The module keeps its identity, parameters, hooks and state-dict keys, so a
    user holding it sees the same object; torch 2.13.0's ``nn.Module`` keeps all of it in ``__dict__``."""
    if not (issubclass(cls, type(module)) or issubclass(type(module), cls)):
        raise TypeError(f"swap_class gives a module a subclass of its class or takes one back, not {type(module).__name__} -> {cls.__name__}")
    module.__class__ = cls


def pair(value: Any) -> tuple[Any, Any]:
    """A pooling option as (height, width), as ``nn.MaxPool2d`` reads it (``nn.modules.utils._pair``, torch 2.13.0)."""
    from torch.nn.modules.utils import _pair

    return _pair(value)


def dynamo_recompile_limit() -> int:
    """Compiled variants dynamo keeps per function before it runs the Python instead (torch 2.13.0)."""
    import torch._dynamo.config

    return torch._dynamo.config.recompile_limit


def inside_functorch_transform() -> bool:
    """Whether this call runs under a ``torch.func`` transform (vmap, grad...): torch 2.13.0's interpreter stack."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def torchax_convolution() -> Callable[..., Any]:
    """torchax's lowering of ``aten.convolution`` to JAX (``torchax.ops.jaten._aten_convolution``, the
    pinned torchax under torch 2.13.0), for loom's autocast-aware override."""
    from torchax.ops.jaten import _aten_convolution

    return _aten_convolution


def leave_step_unwrapped(step: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an ``Optimizer`` subclass's ``step`` so that ``Optimizer.__init__`` does not wrap it in the
    step hooks (torch 2.13.0 skips a ``step`` whose ``hooked`` is set): its own update runs them,
    through ``Optimizer.profile_hook_step``, only when it updates."""
    step.hooked = True  # type: ignore[attr-defined]
    return step


# torchft's Manager keeps these in private attributes (checked against torchft 0.2.0): it has no
# public getter for whether this replica heals in the current quorum, the quorum's id, or which
# replica groups the quorum holds.
def ft_healing(manager: Any) -> bool:
    """Whether this replica group heals in the current quorum (torchft 0.2.0's ``Manager._healing``)."""
    return manager._healing


def ft_quorum_id(manager: Any) -> int:
    """The id of the current quorum, which changes with its membership (torchft 0.2.0's ``Manager._quorum_id``)."""
    return manager._quorum_id


def ft_quorum_ranks(manager: Any) -> list[int] | None:
    """Global ranks of this process's peers across the quorum's groups, ``group * N + rank`` (torchft 0.2.0
    hands them to its process group's ``configure``, which keeps them as ``ProcessGroupGloo._global_ranks``)."""
    return manager._pg._global_ranks


class _RecordingClient:
    """torchft's ManagerClient, keeping the last quorum's result (it has the quorum's replica ids, which the Manager drops)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.last: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def ft_record_quorums(manager: Any) -> _RecordingClient:
    """Have ``manager`` keep each quorum's result in ``.last`` of the returned client (torchft 0.2.0's ``Manager._client``)."""
    manager._client = _RecordingClient(manager._client)
    return manager._client
