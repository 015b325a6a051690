"""Joining the job's process group, with a timeout and a health monitor, and leaving it cleanly.

A gloo group that is not destroyed before the interpreter exits can abort at teardown
("terminate called without an active exception"); ``Connection.close`` (also run at exit)
destroys it.
"""

from __future__ import annotations

import atexit
import os
from contextlib import contextmanager
from datetime import timedelta
from typing import ClassVar, Iterator

import torch
import torch.distributed as dist

from loom.cluster import ClusterSpec, is_positive_seconds, seconds_from_env
from loom.comm.health import HealthMonitor
from loom.errors import ClusterError

TIMEOUT_ENV = "LOOM_TIMEOUT"
DEFAULT_TIMEOUT = 300.0


def resolve_timeout(timeout: float | None, name: str = "timeout") -> float:
    """Collective timeout in seconds: the argument (called ``name`` in the error), else ``LOOM_TIMEOUT``, else 300."""
    if timeout is None:
        return seconds_from_env(TIMEOUT_ENV, DEFAULT_TIMEOUT)
    if not is_positive_seconds(timeout):
        raise ClusterError(f"{name} must be a finite positive number of seconds, got {timeout}")
    return float(timeout)


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class Connection:
    """This process's membership in the job: the default process group plus its monitor.

    Like torch's default process group, it exists once per process: ``join`` hands every
    strategy in the process the same one, so there is one heartbeat and one set of hooks.
    """

    _open: ClassVar[Connection | None] = None

    @classmethod
    def join(cls, spec: ClusterSpec, device: torch.device, timeout: float, backend: str | None = None) -> Connection:
        """The process's connection, made on first use."""
        live = cls._open
        if live is None:
            cls._open = live = cls(spec, device, timeout, backend)
        elif (live.backend, live.timeout) != (backend or default_backend(device), timeout):
            raise ClusterError(
                f"this process already joined the job with backend {live.backend} and timeout {live.timeout:g}s; "
                f"another strategy in it asked for {backend or default_backend(device)} and {timeout:g}s: use the same"
            )
        return live

    def __init__(self, spec: ClusterSpec, device: torch.device, timeout: float, backend: str | None = None) -> None:
        self.spec = spec
        self.timeout = timeout
        self.backend = backend or default_backend(device)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(
                self.backend,
                store=_attempt_store(spec, timeout),
                rank=spec.rank,
                world_size=spec.world_size,
                timeout=timedelta(seconds=timeout),
                device_id=device if device.type == "cuda" else None,
            )
        elif dist.get_world_size() != spec.world_size:
            raise ClusterError(
                f"the process group has {dist.get_world_size()} ranks but the launcher says WORLD_SIZE="
                f"{spec.world_size}; initialise it with the launcher's values or let loom do it"
            )
        self.monitor = HealthMonitor(spec)
        self.monitor.start()
        atexit.register(self.close)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a broken collective into an error that names the failed rank."""
        try:
            yield
        except RuntimeError as exc:
            error = self.monitor.failure_error(exc)
            if error is None:
                raise
            raise error from exc

    def close(self) -> None:
        """Stop the monitor and destroy the group (idempotent); every strategy sharing it leaves too."""
        if Connection._open is self:
            Connection._open = None
        self.monitor.stop()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False


def _attempt_store(spec: ClusterSpec, timeout: float) -> dist.Store | None:
    """The launcher's store, with keys of their own for each elastic restart.

    After a restart, torchrun's workers meet in the same store as the attempt before, where
    the dead ranks' addresses are still written: a new rank can read one and fail to connect
    ("Connection refused"). A prefix per attempt keeps the attempts apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # not under torchrun: init_process_group's own env:// rendezvous
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(spec.master_addr, spec.master_port, is_master=False, timeout=timedelta(seconds=timeout))
    return dist.PrefixStore(f"loom/attempt-{attempt}", store)
