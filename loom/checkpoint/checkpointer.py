"""Save and restore a job's state on ``torch.distributed.checkpoint``, committed atomically.

Every rank calls ``save``/``restore`` at the same point (``arrival`` names one that does
not, within seconds). Tensors go through DCP: replicated tensors are written once, spread
over the ranks, and a checkpoint loads on any number of replicas. Rank 0 commits: only
once every rank's files are written does the checkpoint get its marker and its final name
(``loom.checkpoint.layout``). ``async_save`` copies the state to shared memory and DCP's
checkpoint process writes it (over a process group of its own, on a port of its own), so
training goes on meanwhile without sharing its interpreter lock with the writer; the commit
follows when the write completes, and at the latest when the process exits.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from weakref import WeakSet

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from loom import comm, compat
from loom.checkpoint import layout
from loom.checkpoint.arrival import meet
from loom.checkpoint.safe_reader import index_file, load, quiet, read_index
from loom.checkpoint.state import apply, check_names, collect, flatten, merge, rng_state, set_rng_state, without
from loom.comm.health import HealthMonitor
from loom.errors import CheckpointError, CheckpointMismatchError
from loom.launch.parent import die_with_parent

FORMAT = 1  # of loom.json and the layout; a checkpoint of another format is refused
SYNC_WRITE_THREADS = 4  # measured on 500 MB: 1 thread 0.70 s, 2 0.33 s, 4 0.26 s; torch.save 0.43 s


class Checkpointer:
    """One process's side of saving and restoring; a strategy owns one."""

    def __init__(self, strategy: str = "") -> None:
        self.strategy = strategy
        self._group: Any = None
        self._pending: Future | None = None  # an asynchronous save, done once committed
        self._stager: DefaultStager | None = None

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    # ---- saving ------------------------------------------------------------------------------
    def save(
        self,
        root: str | Path,
        step: int | None,
        state: dict[str, Any],
        keep: int = 3,
        async_save: bool = False,
        durable: bool = True,
        peers: HealthMonitor | None = None,
    ) -> Path:
        """Write ``state`` as ``root/step-<step>``; returns that path (committed later if async).

        ``step`` None: the one after the newest checkpoint under ``root``. ``durable``: fsync
        every file before the commit (survives a power loss, not just a kill). ``peers``: the
        job's health monitor, to tell a rank that died from one that did not call save.
        """
        _refuse_empty_modules(state, "save")
        layout.chosen_digest()  # a digest setting loom lacks is refused before anything is written
        self.wait()
        meet("save", peers)
        step = self._agree_on_step(root, step)
        tensors, plain, kinds = collect(state)
        temp, final = layout.temp_dir(root, step), layout.step_dir(root, step)
        if self.rank == 0:
            layout.clear_temp(temp)
        comm.barrier()
        layout.write_json(temp / f"rank-{self.rank:05d}.json", {"rng": rng_state()}, durable)
        if self.rank == 0:
            meta = {
                "format": FORMAT,
                "step": step,
                "strategy": self.strategy,
                "world_size": self.world_size,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "kinds": kinds,
                "plain": plain,
            }  # the tensors' keys, shapes and dtypes are in DCP's index
            layout.write_json(temp / "loom.json", meta, durable)
        group, no_dist = self._checkpoint_group(), not dist.is_initialized()
        if async_save:
            self._pending = self._save_in_background(tensors, temp, final, root, keep, durable, group, no_dist)
            _at_exit.add(self)
            # Registered (again) now, after the process group's exit handler, so that it runs first.
            atexit.unregister(_finish_pending_saves)
            atexit.register(_finish_pending_saves)
            return final
        # DCP streams each tensor through a Python file object: one thread writes at half of torch.save's speed
        writer = dcp.FileSystemWriter(temp, sync_files=durable, thread_count=SYNC_WRITE_THREADS)
        with quiet():
            dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=no_dist)
        if self.rank == 0:
            self._commit(temp, final, root, keep)
        comm.barrier()
        return final

    def _save_in_background(
        self, tensors: dict[str, Any], temp: Path, final: Path, root: str | Path, keep: int, durable: bool, group: Any, no_dist: bool
    ) -> Future:
        """Copy the tensors now and write them from DCP's checkpoint process, which holds no lock
        training needs; commit once written. A daemonic process may not start one (Python's
        rule), so there a thread at the lowest priority writes instead."""
        writer = _BackgroundWriter(temp, sync_files=durable)
        committed: Future = Future()
        if multiprocessing.current_process().daemon:
            with quiet():
                written = dcp.async_save(tensors, storage_writer=writer, process_group=group, no_dist=no_dist)
            written.add_done_callback(lambda done: self._commit_after(done, committed, temp, final, root, keep))
            return committed
        if compat.checkpoint_process() is None:  # the first asynchronous save starts it (seconds: it imports torch)
            compat.start_checkpoint_process(*self._checkpoint_process_address(group))
        staged = self._staging().stage(tensors)  # into shared memory, which the checkpoint process reads in place

        def write() -> None:
            with quiet():
                written = dcp.async_save(
                    staged, storage_writer=writer, async_stager=_AlreadyStaged(), process_group=group, no_dist=no_dist,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                )  # fmt: skip
            self._commit_after(written, committed, temp, final, root, keep)

        threading.Thread(target=write, name="loom-checkpoint", daemon=True).start()
        return committed

    def _staging(self) -> DefaultStager:
        """Shared-memory copies of the state, kept from one save to the next (their storage is reused)."""
        if self._stager is None:
            options = StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=False, use_non_blocking_copy=False)
            self._stager = DefaultStager(options)
        return self._stager

    def _checkpoint_process_address(self, group: Any) -> tuple[int, int, int, str, int]:
        """Rank, world size, local rank and the address of a port of its own on rank 0's host for
        the checkpoint processes' group (the job's MASTER_PORT is taken by the job's store)."""
        port = torch.tensor([_free_port() if self.rank == 0 else 0])
        comm.broadcast(port, 0, group=group)
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1") if dist.is_initialized() else "127.0.0.1"
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        return self.rank, self.world_size, local_rank, addr, int(port)

    def _agree_on_step(self, root: str | Path, step: int | None) -> int:
        """``step``, or the one after the newest checkpoint as rank 0 sees it, on every rank."""
        if step is not None:
            return step
        chosen = torch.tensor([layout.next_step(root) if self.rank == 0 else 0])
        comm.broadcast(chosen, 0, group=self._checkpoint_group())
        return int(chosen)

    def wait(self) -> None:
        """Block until an asynchronous save is written and committed; raise what it failed with."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except Exception as error:
                raise CheckpointError(f"the asynchronous checkpoint save failed: {error}") from error

    def _commit_after(self, written: Future, committed: Future, temp: Path, final: Path, root: str | Path, keep: int) -> None:
        """Runs on the writer's thread once this rank's part is written (rank 0: all parts)."""
        try:
            written.result()
            if self.rank == 0:
                self._commit(temp, final, root, keep)
            committed.set_result(None)
        except BaseException as error:  # noqa: BLE001 - handed to wait()
            committed.set_exception(error)

    def _commit(self, temp: Path, final: Path, root: str | Path, keep: int) -> None:
        layout.commit(temp, final)
        layout.prune(root, keep)

    # ---- restoring ---------------------------------------------------------------------------
    def restore(
        self, path: str | Path, state: dict[str, Any], fallback: bool = False, strict: bool = True, peers: HealthMonitor | None = None
    ) -> dict[str, Any] | None:
        """Load the latest complete checkpoint under ``path`` (or ``path`` itself) into ``state``.

        Returns the saved plain values with ``step``, or None when there is no checkpoint yet.
        With ``fallback``, a damaged checkpoint is reported and the one before it is tried.
        With ``strict=False``, tensors that only one side has are skipped, and reported.
        """
        _refuse_a_file(Path(path))
        _refuse_empty_modules(state, "restore")
        self.wait()
        meet("restore", peers)
        candidates = _candidates(Path(path), fallback)
        for i, candidate in enumerate(candidates):
            try:
                return self._restore(candidate, state, strict)
            except CheckpointMismatchError:
                raise  # an older checkpoint of the same run would not match either
            except CheckpointError as error:
                if i == len(candidates) - 1 and not fallback:
                    raise CheckpointError(f"{error}; restore(..., fallback=True) takes the newest intact checkpoint before it") from error
                if i == len(candidates) - 1:
                    raise CheckpointError(f"{error}; none of the {len(candidates)} checkpoint(s) tried is intact") from error
                if self.rank == 0:
                    warnings.warn(f"loom: skipping a damaged checkpoint: {error}; trying the one before it", stacklevel=3)
        return None

    def _restore(self, path: Path, state: dict[str, Any], strict: bool) -> dict[str, Any]:
        listed = layout.verify(path, contents=False)  # every file there, at its size
        mine = path / f"rank-{self.rank:05d}.json"
        # What decides what to read is checked before it is read, the same files on every rank;
        # the tensors' files as DCP reads them.
        listed.check([index_file(path).name] + [n for n in listed.sizes if n.endswith(".json")])
        meta = layout.read_json(path / "loom.json")
        if meta.get("format") != FORMAT:
            raise CheckpointMismatchError(
                f"{path}: saved in checkpoint format {meta.get('format')!r}, and this loom reads format {FORMAT}: "
                "restore it with the loom version that saved it (or a newer one)"
            )
        check_names(state, meta["kinds"], path)
        index = read_index(path, listed)
        tensors, _, _ = collect({k: v for k, v in state.items() if meta["kinds"].get(k) != "value"}, meta["plain"])
        missing, unexpected = check_match(flatten(tensors), index.state_dict_metadata, path, strict)
        tensors = without(tensors, set(missing))
        load(tensors, path, index, listed, self._checkpoint_group())  # each tensor once its blocks' digests match
        apply(state, meta["kinds"], merge(tensors, meta["plain"]), strict)
        if mine.name in listed.sizes and meta["world_size"] == self.world_size:
            set_rng_state(layout.read_json(mine)["rng"])
        restored = {
            **{k: v for k, v in meta["plain"].items() if meta["kinds"][k] == "value"},
            "step": meta["step"],
            "path": str(path),
            "strategy": meta["strategy"],
            "world_size": meta["world_size"],
        }
        if not strict:
            restored.update(missing_keys=missing, unexpected_keys=unexpected)
            if (missing or unexpected) and self.rank == 0:
                warnings.warn(_partial(path, missing, unexpected), stacklevel=4)
        return restored

    def _checkpoint_group(self) -> Any:
        """A gloo group of its own, so a background write never interleaves with training's collectives."""
        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group


class _BackgroundWriter(dcp.FileSystemWriter):
    """Writes an asynchronous checkpoint at the lowest CPU priority (its thread, in the checkpoint
    process or in this one).

    On a busy CPU an ordinary writer preempts one of the training step's intra-op threads, and
    the whole parallel op waits for it: steps ran 3-4x slower during the write. At nice 19 the
    write takes longer and the steps run at their usual speed.
    """

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled in the checkpoint process only, before it writes: there it quiets the root
        logger DCP sets to INFO, and makes the process die with the trainer (the thread that
        started it: the one that made the first asynchronous save), whose commit it serves."""
        self.__dict__.update(state)
        logging.getLogger().setLevel(logging.WARNING)
        die_with_parent(signal.SIGKILL)  # not Linux: it ends when it next reads from its pipe
        if os.getppid() == 1:  # the trainer died before this took effect
            os._exit(1)

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass
        return super().write_data(plan, planner)


class _AlreadyStaged(AsyncStager):
    """The state is already copied (``Checkpointer._staging``): DCP's own staging would copy it again."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _finish_pending_saves() -> None:
    """At exit, before the process group is left: a worker ending with ``os._exit``
    (``loom.launch.worker``) would otherwise kill an asynchronous save's writer mid-file."""
    for checkpointer in list(_at_exit):
        try:
            checkpointer.wait()
        except CheckpointError as error:  # too late to raise: say so in one line
            print(f"loom: {error}", file=sys.stderr, flush=True)
    compat.stop_checkpoint_process()


_at_exit: WeakSet[Checkpointer] = WeakSet()  # those that started an asynchronous save


def _refuse_a_file(path: Path) -> None:
    """A checkpoint is a directory: a file in one (its ``loom.json``) would find no checkpoint, and restore nothing."""
    if path.is_file():
        inside = (path.parent / layout.MARKER).is_file()
        where = f"pass the checkpoint directory {path.parent} (or the one holding it, for its newest)" if inside else "pass a checkpoint directory"
        raise ValueError(f"restore() takes a directory, and {path} is a file: {where}")


def _refuse_empty_modules(state: dict[str, Any], verb: str) -> None:
    """A module with no parameters or buffers has nothing to save or load (DCP's own error is torch's, not the user's)."""
    for name, value in state.items():
        if isinstance(value, torch.nn.Module) and not value.state_dict():
            raise ValueError(
                f"{verb}({name}=...) got a {type(value).__name__} with no parameters or buffers: nothing to {verb}; "
                "pass the model that holds the weights (the module given to prepare(), or what it returned)"
            )


def _candidates(path: Path, fallback: bool) -> list[Path]:
    """The checkpoint ``path`` names (itself, or the newest under it), then older ones with ``fallback``."""
    if (path / layout.MARKER).is_file():
        older = [p for p in reversed(layout.committed(path.parent)) if layout.step_of(p) < layout.step_of(path)]
        return [path] + (older if fallback else [])
    found = list(reversed(layout.committed(path)))
    return found if fallback else found[:1]


def check_match(wanted: dict[str, Any], saved: dict[str, Any], path: Path, strict: bool = True) -> tuple[list[str], list[str]]:
    """Tensors missing from the checkpoint, and the checkpoint's tensors not wanted here.

    A shape that differs is an error, named with both shapes; with ``strict``, so is the
    first key that only one side has.
    """
    missing = []
    for key, tensor in wanted.items():
        entry = saved.get(key)
        if entry is None or not hasattr(entry, "size"):
            if strict:
                raise CheckpointMismatchError(
                    f"checkpoint does not match: {path} has no tensor '{key}' (here {list(tensor.shape)}); "
                    "is it a checkpoint of this model? (restore(..., strict=False) loads the tensors both have)"
                )
            missing.append(key)
        elif list(entry.size) != list(tensor.shape):
            raise CheckpointMismatchError(
                f"checkpoint does not match: '{key}' is {list(entry.size)} in {path} and {list(tensor.shape)} here"
            )
    roots = {key.split(".", 1)[0] for key in wanted}
    unexpected = [key for key in saved if key.split(".", 1)[0] in roots and key not in wanted]
    if unexpected and strict:
        key = unexpected[0]
        raise CheckpointMismatchError(f"checkpoint does not match: {path} has '{key}' {list(saved[key].size)}, which is not here")
    return missing, unexpected


def _partial(path: Path, missing: list[str], unexpected: list[str]) -> str:
    """What a restore with ``strict=False`` skipped, in one line."""

    def some(keys: list[str]) -> str:
        return ", ".join(keys[:5]) + (f", and {len(keys) - 5} more" if len(keys) > 5 else "") if keys else "none"

    return (
        f"loom: restored part of {path}: {len(missing)} tensor(s) not in the checkpoint kept their values "
        f"({some(missing)}), {len(unexpected)} of its tensor(s) were not used ({some(unexpected)})"
    )
