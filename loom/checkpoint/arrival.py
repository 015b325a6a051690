"""Every replica calls save and restore: one that does not is named within a minute.

``if rank == 0: strategy.save(...)`` is the habit of single-writer checkpoints. A DCP save is
collective, so the ranks that called it would wait in its first collective for the whole
collective timeout, then fail with gloo's words. Instead each rank announces in the job's
store that it reached its n-th save, and waits a while for the others: a rank that is
alive and does not come (or has finished) did not call save.
"""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path

import torch.distributed as dist

from loom.cluster import seconds_from_env
from loom.comm.health import HealthMonitor
from loom.compat import default_store
from loom.errors import CheckpointError

WAIT_ENV = "LOOM_SAVE_TIMEOUT"
DEFAULT_WAIT = 60.0  # a healthy job never waits it out; a rank that lags one slow step must not fail the job
POLL = 0.05
_LOOM = str(Path(__file__).resolve().parents[1]) + os.sep
_calls: dict[str, int] = {}  # this process's saves and restores so far: the same count on every rank


def resolve_wait() -> float:
    """Seconds to wait for the other ranks to arrive (``LOOM_SAVE_TIMEOUT``, default 60)."""
    return seconds_from_env(WAIT_ENV, DEFAULT_WAIT)


def call_site() -> str:
    """``file:line`` of the code outside loom that called in (the user's ``save`` or ``fit``)."""
    frame = inspect.currentframe()
    while frame is not None and frame.f_code.co_filename.startswith(_LOOM):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


def meet(what: str, peers: HealthMonitor | None = None) -> None:
    """Return once every rank has called ``what`` (save, restore) as often as this one.

    Raises one line naming the ranks that did not, when they finished instead or are alive
    but did not come within ``LOOM_SAVE_TIMEOUT`` seconds; a rank that died is named as such
    (by ``peers``, the job's health monitor, when there is one).
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store, rank, world = default_store(), dist.get_rank(), dist.get_world_size()
    number = _calls[what] = _calls.get(what, 0) + 1
    keys = [f"loom/{what}/{number}/{r}" for r in range(world)]
    where = call_site()
    store.set(keys[rank], where)
    wait = resolve_wait()
    deadline = time.monotonic() + wait
    while not store.check(keys):
        missing = [r for r in range(world) if not store.check([keys[r]])]
        finished = [r for r in missing if peers is not None and peers.finished(r)]
        if finished or time.monotonic() > deadline:
            break
        time.sleep(POLL)
    else:
        if number > 1:  # every rank is past its previous call: that key is read no more
            store.delete_key(f"loom/{what}/{number - 1}/{rank}")
        return
    if not finished and peers is not None:
        failed = peers.failure_error()  # a dead or silent rank, not a skipped call
        if failed is not None:
            raise failed
    came = [r for r in range(world) if r not in missing]
    why = "finished without calling it" if finished else f"did not call it within {wait:g}s ({WAIT_ENV} sets how long to wait)"
    raise CheckpointError(
        f"strategy.{what}() was called at {where} on rank(s) {_ranks(came)}, but rank(s) {_ranks(missing)} {why}: "
        f"every replica must call {what}() at the same point, since all ranks write and read a checkpoint "
        f"together (no `if rank == 0:` around it)"
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
