"""Local devices and the per-process CPU thread budget.

Oversubscribed threads are the usual reason CPU data parallelism is slow: N processes that
each start one thread per core fight over the cores. Each process gets ``cores // N``.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from loom.errors import LaunchError

THREADS_ENV = "LOOM_THREADS"


def available_cores() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity, unlike cpu_count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_nproc() -> int:
    """One process per GPU; on a CPU-only machine one per core, at most 8."""
    return cuda_count() or max(1, min(available_cores(), 8))


def default_nproc_reason() -> str:
    """Why ``default_nproc()`` is what it is, in the words of the launcher's first line."""
    if cuda_count():
        return "one per GPU"
    return "one per core" if available_cores() <= 8 else "one per core, at most 8"


def check_nproc(nproc: int) -> None:
    """Refuse more processes than GPUs, where two processes would share one device."""
    gpus = cuda_count()
    if nproc < 1:
        raise LaunchError(f"--nproc must be at least 1, got {nproc}")
    if gpus and nproc > gpus:
        raise LaunchError(
            f"--nproc {nproc} asks for more processes than this machine's {gpus} CUDA device(s); "
            f"use --nproc {gpus} or fewer (one process per GPU)"
        )


def thread_budget(local_processes: int, cores: int | None = None) -> int:
    """Intra-op threads for each of ``local_processes`` processes sharing this machine."""
    cores = available_cores() if cores is None else cores
    return max(1, cores // max(1, local_processes))


def apply_thread_budget(local_processes: int) -> int | None:
    """Set torch's intra-op thread count to this process's share of the cores, where loom may.

    The count is process-wide state, so a strategy sets it only in a process loom owns, started
    by ``loom run`` or ``loom.launch`` (whose ``--threads`` flag, else cores / local processes,
    arrives as ``LOOM_THREADS``), or where the user asks by setting ``LOOM_THREADS`` (a number,
    or ``auto`` for cores / local processes). Any other process (plain torchrun, a notebook)
    keeps its own, and is told once if its threads oversubscribe the cores. Returns the count
    set, or None.
    """
    asked = os.environ.get(THREADS_ENV, "")
    if not asked:
        _warn_if_oversubscribed(local_processes, torch.get_num_threads(), available_cores())
        return None
    if asked == "auto":
        threads = thread_budget(local_processes)
    elif asked.isdigit() and int(asked) > 0:
        threads = int(asked)
    else:
        raise LaunchError(f"{THREADS_ENV}={asked!r} is not a number of threads: use a positive number, or 'auto' for cores / local processes")
    torch.set_num_threads(threads)
    return threads


@functools.cache  # once per process and figures
def _warn_if_oversubscribed(local_processes: int, threads: int, cores: int) -> None:
    if threads * local_processes > cores:
        warnings.warn(
            f"loom: {local_processes} processes on this machine with {threads} threads each oversubscribe its {cores} "
            f"cores, and loom leaves torch's thread count to the process that owns it: set {THREADS_ENV}=auto (or "
            f"OMP_NUM_THREADS={thread_budget(local_processes, cores)}), or start the job with `loom run`",
            stacklevel=3,
        )


def local_device(local_rank: int) -> torch.device:
    """The device a replica with this local rank computes on."""
    gpus = cuda_count()
    if not gpus:
        return torch.device("cpu")
    if local_rank >= gpus:
        raise LaunchError(
            f"local rank {local_rank} has no GPU: this machine has {gpus}; start at most {gpus} processes per node"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
