"""Each rank's record of its recent collectives, and how the ranks share theirs.

Two halves make the record. torch's flight recorder keeps, per process group, a ring of the
last collectives in C++ (op, shapes, dtypes, sequence number, whether it finished): every
collective of the job, DDP's bucketed all-reduces too. It works for gloo as for NCCL once
``TORCH_FR_BUFFER_SIZE`` is set before the first collective (``arm``). Its Python stacks are
not used: turning them into frames imports torch's compiler (seconds, at the worst moment).
So ``arm`` also stamps each call of ``torch.distributed``'s collectives with the user's call
site and the time, in a ring of our own; an entry of the recorder takes the site of the call
it was made in. A record is only read when asked for: a rank that hits a broken collective
asks every rank, through the job's store, and each rank's heartbeat thread answers with its
record and the stack of its main thread, without stopping it.

Some calls that every rank of a group must make in the same order are not one collective:
a pipeline's step is its stages' sends and receives, which the recorder does not see on gloo.
``exchange`` records such a call as one entry of a group of its own, numbered like a collective.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

import loom
from loom.compat import flight_recorder_entries

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
DEFAULT_BUFFER = 1000  # collectives remembered per process
KEEP = 200  # of which a record carries the newest
STAMPED = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "all_gather_object",
           "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
           "all_to_all_single", "broadcast_object_list", "send", "recv", "monitored_barrier",
           "all_gather_single", "reduce_scatter_single")  # fmt: skip
_INTERNAL = (*(str(Path(m.__file__).parent) + os.sep for m in (torch, loom)), sysconfig.get_paths()["stdlib"] + os.sep)
_user_files: dict[str, bool] = {}  # file -> whether it is the user's, decided once
_stamps: collections.deque = collections.deque(maxlen=DEFAULT_BUFFER)  # [start_ns, end_ns, thread, frames]
_exchanges: collections.deque = collections.deque(maxlen=KEEP)  # (start_ns, call) of ``exchange``
_exchange_seq: dict[str, int] = {}  # group -> number of its newest exchange


def _is_user(filename: str) -> bool:
    return not filename.startswith(_INTERNAL) and not filename.startswith("<") and "/runpy.py" not in filename


def _call_site(f: Any) -> list[tuple[str, int, str]]:
    """The user's frames from ``f`` outwards: the call site and two callers (FSDP calls from deep in hooks)."""
    frames, depth = [], 0
    while f is not None and depth < 40 and len(frames) < 3:
        code = f.f_code
        user = _user_files.get(code.co_filename)  # a str caches its hash; a code object does not
        if user is None:
            user = _user_files[code.co_filename] = _is_user(code.co_filename)
        if user:
            frames.append((code.co_filename, f.f_lineno, code.co_name))
        f, depth = f.f_back, depth + 1
    return frames


def _stamped(collective: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(collective)
    def call(*args: Any, **kwargs: Any) -> Any:
        stamp = [time.time_ns(), 0, threading.get_ident(), _call_site(sys._getframe(1))]
        _stamps.append(stamp)
        try:
            return collective(*args, **kwargs)
        finally:
            stamp[1] = time.time_ns()

    call.__loom_stamped__ = True
    return call


def arm_workers() -> None:
    """Have the processes this one starts record their collectives (the user's ``TORCH_FR_BUFFER_SIZE`` wins)."""
    os.environ.setdefault(BUFFER_ENV, str(DEFAULT_BUFFER))


def arm() -> None:
    """Record this process's collectives from now on (call before its first one)."""
    arm_workers()
    for name in STAMPED:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "__loom_stamped__", False):
            setattr(dist, name, _stamped(fn))


@contextlib.contextmanager
def exchange(op: str, group: str, hint: str) -> Iterator[None]:
    """Record the call made in this block as one collective ``op`` of ``group`` (a name of its own, not a
    process group's), from the user's line; ``hint``: what to do when the ranks' calls part there.
    It stays in flight if the block raises: the rank never finished it."""
    seq = _exchange_seq[group] = _exchange_seq.get(group, 0) + 1
    frames = [{"file": f, "line": n, "name": name} for f, n, name in _call_site(sys._getframe(1))]
    call = {"group": group, "seq": seq, "op": op, "shapes": [], "dtypes": [], "frames": frames, "done": False, "hint": hint}
    _exchanges.append((time.time_ns(), call))
    yield
    call["done"] = True


def _site_of(entry: dict[str, Any], stamps: list[list]) -> list[dict[str, Any]]:
    """The user's frames of the stamped call the recorder's entry was made in (none for C++'s own, like DDP's)."""
    made, thread = entry["time_created_ns"], int(entry.get("thread_id") or 0)
    for start, end, tid, frames in reversed(stamps):
        if tid == thread and start <= made and (end == 0 or made <= end):
            return [{"file": f, "line": n, "name": name} for f, n, name in frames]
    return []


def recent_calls(keep: int = KEEP) -> list[dict[str, Any]]:
    """The newest ``keep`` collectives this process issued, oldest first, as plain dicts."""
    stamps = list(_stamps)
    calls = [(start, dict(call)) for start, call in list(_exchanges)]
    for e in flight_recorder_entries()[-keep:]:
        calls.append((e["time_created_ns"], {
            "group": str(e["process_group"][0]),
            "seq": int(e["collective_seq_id"] or e["p2p_seq_id"]),
            "op": e["profiling_name"].rsplit(":", 1)[-1],
            "shapes": e["input_sizes"],
            "dtypes": e["input_dtypes"],
            "frames": _site_of(e, stamps),
            "done": bool(e["retired"]),
        }))  # fmt: skip
    return [call for _, call in sorted(calls, key=lambda c: c[0])[-keep:]]


def user_frames(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The frames of the user's code: not torch's, loom's or the interpreter's."""
    return [f for f in frames if _is_user(f["file"])]


def snapshot(rank: int, host: str, stack: str, failed_in_last: bool = False, finished: bool = False) -> dict[str, Any]:
    """This rank's record: its collectives and where its main thread is (``stack``).

    ``failed_in_last``: the caller's newest collective just raised, so it is where this rank
    is stuck (torch may have retired it already).
    """
    calls = recent_calls()
    if failed_in_last and calls:
        calls[-1]["done"] = False
    waits_at = [{"file": f["file"], "line": f["line"], "name": f["name"]} for f in user_frames(stack)[:3]]
    for call in calls:
        if not call["done"] and not call["frames"]:  # made in C++ or by torch's own Python (DDP, FSDP)
            call["where"] = waits_at  # the user's lines the main thread waits at; kept out of the call's signature
    return {"rank": rank, "host": host, "pid": os.getpid(), "calls": calls, "stack": stack, "finished": finished}


def request(store: dist.Store, prefix: str) -> int:
    """Ask every rank for its record; returns the request's number."""
    return store.add(f"{prefix}/record-request", 1)


def publish(store: dist.Store, prefix: str, record: dict[str, Any], answers: int) -> None:
    store.set(f"{prefix}/record/{record['rank']}", json.dumps({**record, "answers": answers}))


def answer(store: dist.Store, prefix: str, answered: int, make: Callable[[], dict[str, Any]]) -> int:
    """Publish a record if one was asked for since ``answered``; returns the newest request answered."""
    asked = store.add(f"{prefix}/record-request", 0)
    if asked > answered:
        publish(store, prefix, make(), asked)
    return asked


def collect(store: dist.Store, prefix: str, world_size: int, asked: int, wait: float) -> dict[int, dict[str, Any]]:
    """Every rank's record that answers request ``asked`` (or was left by a finished rank) within ``wait`` seconds."""
    deadline = time.monotonic() + wait
    records: dict[int, dict[str, Any]] = {}
    while True:
        for r in range(world_size):
            key = f"{prefix}/record/{r}"
            if r not in records and store.check([key]):
                record = json.loads(store.get(key))
                if record["answers"] >= asked or record["finished"]:
                    records[r] = record
        if len(records) == world_size or time.monotonic() > deadline:
            return records
        time.sleep(0.1)
