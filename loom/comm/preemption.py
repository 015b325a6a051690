"""SIGTERM as a preemption notice: finish the step, save a checkpoint, exit 0.

Schedulers (Kubernetes, Slurm, spot instances) send SIGTERM and wait a grace period before
killing. Once armed, the signal only sets a flag; ``Strategy.preempted()`` combines the flags
of all replicas at a step boundary, so every replica stops after the same step and they can
save together. Unarmed, SIGTERM ends the process as before. A rank whose peer has died still
exits at once naming it (``loom.comm.health``): that SIGTERM is not a preemption.

``fit`` arms only while it trains (``armed_while``): afterwards SIGTERM ends the process again,
and one that came after fit's last step boundary is delivered then, as if unarmed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

_requested = threading.Event()
_armed = False


def arm() -> None:
    """From now on, SIGTERM asks for a save at the next step boundary instead of ending the process."""
    global _armed
    _armed = True
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)  # no health monitor: one process


def disarm() -> None:
    """SIGTERM ends the process again; one that came while armed and was not acted on is delivered now."""
    _unarm()
    if _requested.is_set():
        _requested.clear()
        signal.raise_signal(signal.SIGTERM)


@contextmanager
def armed_while() -> Iterator[None]:
    """Armed in this block only (unless it already was): a request not acted on in it ends the
    process when the block is left, as the SIGTERM would have. Left by the preemption's own exit
    (``SystemExit`` with a request), it stays armed: a second SIGTERM cannot cut that exit short."""
    if _armed:
        yield
        return
    arm()
    exiting = False
    try:
        yield
    except SystemExit:
        exiting = _requested.is_set()
        raise
    finally:
        if not exiting:
            disarm()


def _unarm() -> None:
    global _armed
    _armed = False
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _on_sigterm(signum: int, frame: object) -> None:
    request()


def armed() -> bool:
    return _armed


def request() -> None:
    if not _requested.is_set():
        _requested.set()
        os.write(sys.stderr.fileno(), b"loom: SIGTERM received: saving a checkpoint after this step, then exiting\n")


def requested() -> bool:
    """Whether this process has been asked to stop (``Strategy.preempted`` asks every replica)."""
    return _requested.is_set()
