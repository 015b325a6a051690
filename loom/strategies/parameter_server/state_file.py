"""A parameter server's state on disk: one safetensors snapshot, replaced atomically, and its
recovery from that snapshot and the write-ahead log (``wal.py``).

A server that comes back without updates a worker saw (its files removed or damaged) cannot
recover them: ``LostUpdatesError`` and ``lost_message`` say so, in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from loom.errors import CheckpointError
from loom.strategies.parameter_server import wal
from loom.strategies.parameter_server.optimizers import ServerOptimizer
from loom.strategies.parameter_server.rounds import Round

if TYPE_CHECKING:
    from loom.strategies.parameter_server.server import ParameterServer


class LostUpdatesError(Exception):
    """A worker has seen updates that this server, restarted, no longer has."""


def lost_message(lost: dict[str, int]) -> str:
    """One line on updates a restarted server lost (``lost``: the newest version a worker saw, and the one it came back at)."""
    count = lost["seen"] - lost["resumed_at"]
    return (
        f"lost {count} updates that workers saw applied: it came back at update {lost['resumed_at']}, a worker had seen "
        f"update {lost['seen']} (its state files were removed or damaged); they cannot be recovered, so the job stops: "
        "start it again from its last checkpoint"
    )


def save(server: ParameterServer, path: str | os.PathLike) -> None:
    """Everything ``server`` holds, in one safetensors file replaced atomically (no pickle).

    With a log (``recover``) the snapshot starts the log's next generation, and the ones it
    holds are removed once it is in place.
    """
    from safetensors.torch import save_file

    locks = [server._round_lock] + [server._locks[n] for n in sorted(server._locks)] + [server._seq_lock]  # as updates take them
    for lock in locks:  # one consistent snapshot: no push half in it
        lock.acquire()
    try:
        tensors = {f"dense/{n}": t.clone() for n, t in server.dense.items()}
        tensors.update({f"table/{n}": t.clone() for n, t in server.tables.items()})
        for round_, pending in server._rounds.items():  # shares acknowledged but not yet applied
            tensors.update({f"round/{round_}/{key}": t.clone() for key, t in pending.tensors().items()})
        steps = {}
        for var, slots in server.optimizer.state.items():
            steps[var] = slots["step"]
            tensors.update({f"opt/{var}/{k}": v.clone() for k, v in slots.items() if isinstance(v, torch.Tensor)})
        rotated = server.log is not None and Path(path) == server.log.snapshot
        if rotated:
            with server._log_lock:
                server.log_from = server.log.rotate()
        meta = {
            "optimizer": {k: v for k, v in dataclasses.asdict(server.optimizer).items() if k != "state"},
            "steps": steps,
            "version": server.version,
            "applied": server.applied,
            "last_seq": server._last_seq,
            "closures": sorted(server.closures),
            "staleness": server.staleness,
            "created": server.created,
            "progress": server.progress,
            "joined": sorted(server.joined),
            "finished": server.finished,
            "round": server.round,
            "lineage": server.lineage,
            "rounds": {r: {"expected": p.expected, "workers": sorted(p.workers)} for r, p in server._rounds.items()},
            "log_from": server.log_from,
        }
    finally:
        for lock in reversed(locks):
            lock.release()
    temp = f"{path}.tmp-{os.getpid()}"
    save_file(tensors, temp, metadata={"loom": json.dumps(meta)})
    os.replace(temp, path)
    if rotated:
        server.log.prune(before=server.log_from)


def restore(cls: type[ParameterServer], token: str, path: str | os.PathLike) -> ParameterServer:
    """A server with the state ``save`` wrote; pushes already applied stay applied once.

    The file is read as safetensors and JSON only: anything else (a pickle, say) is refused
    in one line, unread.
    """
    meta, tensors = _read_state(path)
    optimizer = ServerOptimizer(**meta["optimizer"])
    for var, step in meta["steps"].items():
        optimizer.state[var] = {"step": step}
    for key, value in tensors.items():
        kind, rest = key.split("/", 1)
        if kind == "opt":
            var, slot = rest.rsplit("/", 1)
            optimizer.state[var][slot] = value
    dense = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("dense/")}
    tables = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("table/")}
    server = cls(token, dense, tables, optimizer)
    server.created = meta["created"]
    server.version, server.applied, server._last_seq = meta["version"], meta["applied"], meta["last_seq"]
    server.closures = set(meta.get("closures", []))
    server.staleness = {int(k): v for k, v in meta["staleness"].items()}
    server.progress, server.joined, server.finished = meta["progress"], set(meta["joined"]), meta["finished"]
    server.round = meta["round"]
    server.lineage = meta.get("lineage", [])
    server.log_from = meta.get("log_from", 0)
    for round_, info in meta["rounds"].items():
        shares = {key.split("/", 2)[2]: t for key, t in tensors.items() if key.startswith(f"round/{round_}/")}
        server._rounds[int(round_)] = Round.restored(info["expected"], info["workers"], shares)
    return server


def recover(cls: type[ParameterServer], token: str, path: str | os.PathLike, durable: bool = True) -> tuple[ParameterServer, str]:
    """The state kept at ``path``: its snapshot, if any, with its log replayed; and a line
    saying what came back (empty when nothing was kept). From then on every change is logged
    before it is acknowledged (``durable``: and fsync'd; else a power cut may lose what
    ``kill -9`` does not).

    A server that came back is snapshotted at once, so the log it writes next never follows
    damage that a later recovery would stop at.
    """
    snapshot = Path(path)
    server = restore(cls, token, snapshot) if snapshot.exists() else cls(token)
    from_snapshot = server.version
    replay = wal.read(snapshot, server.log_from)
    for fields, tensors in replay.records:
        server._replay(fields, tensors)
    server.resumed_at = server.version
    server.log = wal.WriteAheadLog(snapshot, max([server.log_from - 1, *wal.generations(snapshot)]) + 1, durable)
    if not (snapshot.exists() or replay.records):
        return server, ""
    save(server, snapshot)
    line = f"{server.version} updates: {from_snapshot} from its snapshot, {server.version - from_snapshot} from its log"
    if replay.damage:
        line += f"; the log ends early: {replay.damage}"
    return server, line


def _read_state(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A state file's JSON metadata and tensors, read as safetensors (never unpickled); one line if it is anything else."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as file:
            meta = json.loads(file.metadata()["loom"])
            return meta, {key: file.get_tensor(key) for key in file.keys()}
    except (SafetensorError, KeyError, TypeError, ValueError) as error:
        raise CheckpointError(
            f"{path} is not a parameter-server state file loom wrote ({type(error).__name__}: {error}); it is not loaded: "
            "remove it to start that server afresh"
        ) from None
