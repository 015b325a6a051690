"""Where a rank's Python is, read without stopping it; ``loom stacks`` for a running job.

A rank's heartbeat thread reads the main thread's frames (``sys._current_frames`` is public
CPython API) whether the main thread spins in Python or waits inside a collective, so a stuck
rank is looked at in place. ``loom stacks`` asks every rank of a running job through the job's
store, as a rank that hits a broken collective does, and prints what each answered.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from loom.comm.health import PREFIX
from loom.comm import collective_log
from loom.devices import registered_masters
from loom.errors import LaunchError

WORKER = "loom.launch.worker"


def main_frames(limit: int = 40) -> list[dict[str, Any]]:
    """The main thread's frames, innermost first, each with its source line.

    The innermost ``limit``, then up to ``limit`` of the user's further out: a rank stuck in a
    collective (or reporting its own hang) is deeper than ``limit`` frames inside torch and
    loom, and the user's line is what names the place.
    """
    frame = sys._current_frames().get(threading.main_thread().ident)
    frames, users = [], 0
    while frame is not None and users < limit:
        code = frame.f_code
        if len(frames) < limit or collective_log.user_frames([{"file": code.co_filename}]):
            users += len(frames) >= limit
            frames.append({"file": code.co_filename, "line": frame.f_lineno, "name": code.co_name,
                           "code": linecache.getline(code.co_filename, frame.f_lineno).strip()})  # fmt: skip
        frame = frame.f_back
    return frames


_FAULT_FRAME = re.compile(r'^  File "(.+)", line (\d+) in (.+)$')
_C10D = os.sep + os.path.join("torch", "distributed", "distributed_c10d.py")


def aborted_in(dump: str) -> dict[str, Any] | None:
    """The collective a process was in when a fatal signal ended it, from its ``faulthandler`` dump:
    ``{"op": "reduce", "frames": [the user's frames, innermost first]}``; None when no thread was in one."""
    for block in dump.split("\n\n"):
        frames = [{"file": m[1], "line": int(m[2]), "name": m[3]} for m in map(_FAULT_FRAME.match, block.splitlines()) if m]
        op = next((f["name"] for f in frames if f["file"].endswith(_C10D)), None)
        users = collective_log.user_frames(frames)
        if op is not None and users:
            return {"op": op, "frames": users[:3]}
    return None


def describe(frames: list[dict[str, Any]], depth: int = 4) -> str:
    """``loop.py:9 in spin (while True: x += 1) <- loop.py:14 in <module>``: the user's frames first."""
    shown = collective_log.user_frames(frames) or frames
    parts = []
    for f in shown[:depth]:
        code = f.get("code") or linecache.getline(f["file"], f["line"]).strip()
        parts.append(f"{Path(f['file']).name}:{f['line']} in {f['name']}" + (f" ({code})" if code else ""))
    return " <- ".join(parts) or "no Python frames"


def local_masters() -> set[str]:
    """The store address (``HOST:PORT``) of each loom job with workers on this machine: from the
    environment its workers started with, or (for workers forked from a zygote that started with
    another) from the registry of loom processes (``devices.register_process``)."""
    masters = registered_masters()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if WORKER.encode() not in cmdline:
                continue
            env = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"MASTER_ADDR" in env and b"MASTER_PORT" in env:  # a worker started without them is no job's
            masters.add(f"{env[b'MASTER_ADDR'].decode()}:{env[b'MASTER_PORT'].decode()}")
    return masters


def _connect(master: str | None) -> tuple[dist.TCPStore, str]:
    if master is None:
        found = local_masters()
        if not found:
            raise LaunchError("no loom job runs on this machine; on another node, pass the job's --master HOST:PORT")
        if len(found) > 1:
            raise LaunchError(f"several loom jobs run here ({', '.join(sorted(found))}); pick one with --master HOST:PORT")
        master = found.pop()
    host, _, port = master.rpartition(":")
    try:
        store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    except (RuntimeError, ValueError) as exc:
        raise LaunchError(f"cannot reach the job's store at {master} ({exc}); is the job still running?") from None
    return store, master


def _attempt_prefix(store: dist.TCPStore) -> str:
    """The newest elastic attempt's keys: the one whose ranks are running now."""
    attempt = 0
    while store.check([f"{PREFIX}/{attempt + 1}/member/0"]):
        attempt += 1
    return f"{PREFIX}/{attempt}"


def where(record: dict[str, Any]) -> str:
    """``in all_reduce #57 (train.py:88)``, or what the rank did last."""
    calls = record["calls"]
    pending = [c for c in calls if not c["done"]]
    if pending:
        return f"in {call_name(pending[0])}"
    if calls:
        return f"between collectives (last: {call_name(calls[-1])})"
    return "before its first collective"


def call_name(call: dict[str, Any]) -> str:
    """``all_reduce #57 of group 1 (train.py:88)``: the line it was called from, or the user's line it waits at."""
    frames = call["frames"] or call.get("where")
    site = f" ({Path(frames[0]['file']).name}:{frames[0]['line']})" if frames else ""
    group = "" if call["group"] == "0" else f" of group {call['group']}"
    return f"{call['op']} #{call['seq']}{group}{site}"


def stacks_command(master: str | None, wait: float = 5.0) -> int:
    """Print each rank's position and Python stack; the divergence, if the records show one."""
    from loom.comm.hangs import explain

    store, master = _connect(master)
    prefix = _attempt_prefix(store)
    world = 0
    while store.check([f"{prefix}/member/{world}"]):
        world += 1
    if world == 0:
        raise LaunchError(f"the job at {master} has no running ranks yet")
    records = collective_log.collect(store, prefix, world, collective_log.request(store, prefix), wait)
    for r in range(world):
        record = records.get(r)
        if record is None:
            print(f"rank {r}: no answer within {wait:g}s (stopped, or its heartbeat thread is blocked)")
            continue
        print(f"rank {r} ({record['host']}, pid {record['pid']}): {where(record)}")
        for f in reversed(record["stack"]):  # as a traceback prints them: the innermost last
            print(f"  {f['file']}:{f['line']} in {f['name']}" + (f"\n      {f['code']}" if f.get("code") else ""))
    verdict = explain(records, world)
    if verdict:
        print(f"loom: {verdict}")
    return 0
