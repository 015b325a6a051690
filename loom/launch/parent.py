"""Processes that end with the process that started them, even when it is killed by SIGKILL."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; elsewhere nothing).

    It follows the thread that started the process, not the whole parent: a child started from a
    thread that ends gets ``sig`` then."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass
