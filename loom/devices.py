"""Local devices and the per-process CPU thread budget.

Oversubscribed threads are the usual reason CPU data parallelism is slow: N processes that
each start one thread per core fight over the cores. Each process gets ``cores // N``, where N
counts every loom process on the host, whatever started it: the launcher's plan (its own
processes, and under TF_CONFIG the other workers listed on this host) and a per-host registry
of live loom processes (two ``loom run``s, torchrun), a file per pid that dies with its process.
"""

from __future__ import annotations

import atexit
import functools
import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from loom.errors import LaunchError

THREADS_ENV = "LOOM_THREADS"
HOST_PROCESSES_ENV = "LOOM_HOST_PROCESSES"  # the launcher's count of loom processes on this host
REGISTRY_ENV = "LOOM_PROCESS_REGISTRY"  # where the live processes are listed (default: /dev/shm)


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


def registry_dir() -> Path:
    """This host's list of live loom processes: shared memory, so it never outlives a reboot."""
    root = os.environ.get(REGISTRY_ENV) or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    return Path(root) / f"loom-processes-{os.getuid()}" / socket.gethostname()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def register_process() -> None:
    """List this process on its host until it exits, with its job's store (``MASTER_ADDR:MASTER_PORT``)
    where loom started it, by which ``loom stacks`` finds the job; entries of processes that died are skipped."""
    directory = registry_dir()
    directory.mkdir(parents=True, exist_ok=True)
    entry = directory / str(os.getpid())
    master = [os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT")]
    started_by_loom = HOST_PROCESSES_ENV in os.environ  # not plain torchrun's, nor a notebook's
    # Written in place: a temporary name beside it would be removed by another process's count
    # (live_processes); a reader that finds it empty for a moment passes over it.
    entry.write_text(":".join(master) if all(master) and started_by_loom else "")
    atexit.register(entry.unlink, missing_ok=True)


def registered_masters() -> set[str]:
    """The job stores (``HOST:PORT``) of this host's live loom processes that have one."""
    directory = registry_dir()
    masters = set()
    for entry in directory.iterdir() if directory.is_dir() else ():
        try:
            master = entry.read_text().strip()
        except OSError:
            continue
        if entry.name.isdigit() and _alive(int(entry.name)) and master:
            masters.add(master)
    return masters


def live_processes() -> int:
    """Live loom processes on this host (stale entries, of processes that died, are removed)."""
    directory = registry_dir()
    count = 0
    for entry in directory.iterdir() if directory.is_dir() else ():
        if entry.name.isdigit() and _alive(int(entry.name)):
            count += 1
        else:
            entry.unlink(missing_ok=True)
    return count


def apply_thread_budget(local_processes: int) -> int | None:
    """Set torch's intra-op thread count to this process's share of the host's cores, where loom may.

    The count is process-wide state, so it is set only in a process loom owns, started by
    ``loom run`` or ``loom.launch`` (``--threads N`` arrives as ``LOOM_THREADS=N``, else
    ``auto``), or where the user asks by setting ``LOOM_THREADS`` (a number, or ``auto``).
    Under ``auto`` the cores are divided among the launcher's count of processes on this host
    and the live loom processes listed there, whichever is larger; a process that finds more of
    them than its launcher planned for (another job) says in one line what to pass. Any other
    process (plain torchrun, a notebook) keeps its own count, and is told once if its threads
    oversubscribe the cores. Returns the count set, or None.
    """
    register_process()  # counted by the others, whatever its own budget
    asked = os.environ.get(THREADS_ENV, "")
    if not asked:
        _warn_if_oversubscribed(local_processes, torch.get_num_threads(), available_cores())
        return None
    if asked == "auto":
        threads = _host_share(local_processes)
    elif asked.isdigit() and int(asked) > 0:
        threads = int(asked)
    else:
        raise LaunchError(f"{THREADS_ENV}={asked!r} is not a number of threads: use a positive number, or 'auto' for cores / local processes")
    torch.set_num_threads(threads)
    return threads


def _host_share(local_processes: int) -> int:
    planned = max(local_processes, int(os.environ.get(HOST_PROCESSES_ENV) or 0))
    found = live_processes()
    threads = thread_budget(max(planned, found))
    if found > planned:
        print(
            f"loom: {found} loom processes share this host's {available_cores()} cores (another job?); this one takes "
            f"{threads} thread(s): pass --threads {threads} to each job to keep the others from taking more",
            file=sys.stderr,
            flush=True,
        )
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
