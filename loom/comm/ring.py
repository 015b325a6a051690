"""Who watches whom: each rank watches the next few peers round a ring, and one alarm wakes them all.

When every rank read every other rank's heartbeat, each made about 2N store requests a second,
2N² in all: at 128 ranks more than the job's one store answers, and the monitors' own beats ran
late. Instead rank r watches the ``WATCHED`` ranks after it, round the ring, that have not
finished (a rank that finishes hands its watch on to the next), so every live rank has
``WATCHED`` watchers and each rank's load is the same whatever N. The watcher that finds a
peer gone raises the alarm: one request that sets every rank's alarm key, on which each rank's
listener waits in the store (a wait the store answers when the key is set: no polling, so no
load, and no delay beyond the watcher's own beat). Nothing is taken over when a watcher dies:
its own watchers find it, and the job stops anyway. A watched peer on the watcher's host is
gone when its process is (``pid_alive``), one on another host when its agent says so.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

WATCHED = 2  # peers each rank watches: every live rank is seen by this many
LISTEN = timedelta(days=7)  # one wait for the alarm; renewed when it runs out (a socket's poll takes int milliseconds)
STOP = "\0stop"  # what a rank's own ``stop`` leaves in its alarm key to end its listener


def key(prefix: str, kind: str, rank: int) -> str:
    return f"{prefix}/{kind}/{rank}"


def watched(store: dist.Store, prefix: str, rank: int, world_size: int, finished: set[int]) -> list[int]:
    """The next ``WATCHED`` peers after ``rank`` round the ring that have not finished (``finished``:
    those seen done so far, which this adds to: each peer's ``done`` is read until it is set)."""
    peers: list[int] = []
    for step in range(1, world_size):
        peer = (rank + step) % world_size
        if peer in finished:
            continue
        if store.check([key(prefix, "done", peer)]):
            finished.add(peer)
            continue
        peers.append(peer)
        if len(peers) == WATCHED:
            break
    return peers


def raise_alarm(store: dist.Store, prefix: str, world_size: int, reason: str) -> None:
    """Wake every rank's listener with ``reason``; the first rank to raise it speaks, so a
    failure that many see costs the store one fan-out, not one per rank."""
    if store.add(f"{prefix}/alarm-claim", 1) == 1:
        store.multi_set([key(prefix, "alarm", r) for r in range(world_size)], [reason] * world_size)


def listen(store: dist.Store, prefix: str, rank: int) -> str:
    """Block until this rank's alarm key is set; what it says (``STOP`` when this rank stopped)."""
    alarm = key(prefix, "alarm", rank)
    while True:
        try:
            store.wait([alarm], LISTEN)
            return store.get(alarm).decode()
        except dist.DistStoreError:  # the wait ran out (after a week): wait again
            continue


def stop_listening(store: dist.Store, prefix: str, rank: int) -> None:
    store.set(key(prefix, "alarm", rank), STOP)


def pid_alive(pid: int) -> bool:
    """False for a missing or zombie (killed, not yet reaped) process on this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to signal 0, which cannot see zombies
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
