"""glibc's malloc told to keep freed memory for the next step (the fast path's ``reuse_memory``).

glibc serves a block above its mmap threshold by ``mmap`` and unmaps it at ``free``, and trims
the top of its heap beyond another threshold, so each step of a convolutional model on CPU
faults its activations' pages in afresh (a third of a W2 step). No mmap and no trim keep them:
the next step reuses them. It changes no number; the process's resident memory stays at its peak.

Two ways to set it, the first preferred:

- **before the process starts**, by glibc's tunables in the environment: loom's launcher gives
  ``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647`` to every
  process it starts (these two tunables set what ``mallopt(M_MMAP_MAX, 0)`` and
  ``mallopt(M_TRIM_THRESHOLD, ...)`` set, and like them stop the thresholds sliding);
- **in a running process** loom did not start, by ``mallopt`` once, at ``prepare``.

Either is undone by ``release()`` (``prepare(fast_path=False)``): glibc cannot be given its
sliding thresholds back, so they are fixed where they slide to (32 MiB mmap, 64 MiB trim).
A process whose allocator is set already (``MALLOC_*``, a malloc ``LD_PRELOAD`` or
``GLIBC_TUNABLES``) is left as it is.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any, Mapping

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
KEEP = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}  # no mmap, no trim: freed memory serves the next step
SLID = {M_MMAP_MAX: 65536, M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 64 << 20}  # where glibc's thresholds slide to
TUNABLES = f"glibc.malloc.mmap_max={KEEP[M_MMAP_MAX]}:glibc.malloc.trim_threshold={KEEP[M_TRIM_THRESHOLD]}"

BY_LAUNCHER = "glibc tunables set by loom's launcher"
BY_MALLOPT = "mallopt in this process, which loom's launcher did not start"
AGAIN = "mallopt in this process, its launcher's setting having been released"


class _State:
    """How this process's allocator was set by loom: process-wide, as the allocator is."""

    how: str | None = None  # BY_LAUNCHER, BY_MALLOPT or AGAIN while memory is kept, else None
    known = False  # ``how`` has been read from the environment the process started with


def launcher_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that make the processes a launcher starts keep memory; none where the
    launching environment sets the allocator itself (then its setting stands)."""
    if refusal(environ) or _glibc() is None:
        return {}
    others = environ.get("GLIBC_TUNABLES")  # tunables of other kinds (glibc.cpu...) stay
    return {"GLIBC_TUNABLES": f"{others}:{TUNABLES}" if others else TUNABLES}


def kept() -> str | None:
    """How this process keeps freed memory, as loom set it (``BY_*``), or None."""
    if not _State.known:
        _State.how, _State.known = BY_LAUNCHER if _started_with_tunables() else None, True
    return _State.how


def keep() -> str | None:
    """Keep freed memory in this process; how it is kept (``BY_*``, ``AGAIN``), or None where it cannot be."""
    if kept() is None and why_not() is None:
        _mallopt(KEEP)
        _State.how = AGAIN if _started_with_tunables() else BY_MALLOPT
    return _State.how


def release() -> bool:
    """Hand freed memory back to the system again, if loom kept it; whether anything changed.
    What the heap holds free now goes back at once (``malloc_trim``)."""
    if kept() is None:
        return False
    _mallopt(SLID)
    _glibc().malloc_trim(0)
    _State.how = None
    return True


def why_not() -> str | None:
    """Why this process's allocator is not loom's to set, or None."""
    if _glibc() is None:
        return "it sets glibc's malloc, and this process has no glibc"
    if _started_with_tunables():  # loom's own, released since
        return None
    return refusal(os.environ)


def refusal(environ: Mapping[str, str]) -> str | None:
    """Why an environment's allocator is set already, or None."""
    tuned = [k for k in environ if k.startswith("MALLOC_")]
    tuned += [k for k in ("LD_PRELOAD", "GLIBC_TUNABLES") if "malloc" in environ.get(k, "")]
    if tuned:
        return f"the process sets its allocator already ({', '.join(sorted(tuned))}), which loom leaves as it is"
    return None


def _started_with_tunables() -> bool:
    """Whether glibc read loom's tunables when this process started. (``os.environ`` is read at
    the interpreter's start; the one process where it holds them unread is a launcher's while it
    runs its workers, and it gives its own value back after. ``/proc/self/environ`` cannot say:
    glibc cuts the variable there as it parses it.)"""
    return os.environ.get("GLIBC_TUNABLES", "").endswith(TUNABLES)


def _mallopt(settings: dict[int, int]) -> None:
    libc = _glibc()
    if libc is None:
        raise RuntimeError("glibc's malloc cannot be set here: this process has no glibc")
    for parameter, value in settings.items():
        libc.mallopt(parameter, value)


@functools.cache
def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # musl has no such function, and other mallopt parameters
    except (OSError, AttributeError):
        return None
    return libc
