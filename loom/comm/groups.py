"""Replica groups (``loom run --groups``): the environment a group's processes get, and the events they report.

Each group is a torchrun-style set of processes; torchft's Manager reads the lighthouse's address
from ``TORCHFT_LIGHTHOUSE`` and the group from ``REPLICA_GROUP_ID``. ``LOOM_FT_JOB`` is what the
launcher of each group computed of the job it runs; groups launched on different hosts compare it
in every quorum (it is part of their torchft replica id). The first process of each group
appends one JSON line per event (a step committed or refused, a group healed) to a file of its own
under ``LOOM_FT_EVENTS``; the launcher reads them to say who left, rejoined and healed, and when.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from loom.errors import LaunchError

GROUP_ENV = "REPLICA_GROUP_ID"
GROUPS_ENV = "NUM_REPLICA_GROUPS"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
EVENTS_ENV = "LOOM_FT_EVENTS"
JOB_ENV = "LOOM_FT_JOB"  # a digest of the script, its arguments, --groups and --nproc: every group must have the same
ADDRESS_ENV = "LOOM_GROUP_ADDRESS"  # where the other groups reach this host (default: its address towards the lighthouse)


def in_groups() -> bool:
    """Whether this process was started by ``loom run --groups``."""
    return GROUP_ENV in os.environ and LIGHTHOUSE_ENV in os.environ


class EventLog:
    """Appends this group's events to ``LOOM_FT_EVENTS/group-<id>.jsonl`` (a no-op without it, or when not ``enabled``)."""

    def __init__(self, group: int, enabled: bool = True) -> None:
        folder = os.environ.get(EVENTS_ENV)
        self.group = group
        self._file = open(Path(folder) / f"group-{group}.jsonl", "a", encoding="utf-8") if folder and enabled else None

    def write(self, event: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"event": event, "t": time.time(), "group": self.group, **fields}) + "\n")
            self._file.flush()  # a kill -9 right after still leaves the line to the launcher


class EventReader:
    """The new lines of every group's event file, oldest first, each time ``read`` is called."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._offsets: dict[Path, int] = {}

    def read(self) -> list[dict[str, Any]]:
        events = []
        for path in sorted(self.folder.glob("group-*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            events += [json.loads(line) for line in complete.decode().splitlines() if line]
        return sorted(events, key=lambda e: e["t"])


def refuse_alone_in_groups(strategy: str, trains_across_groups: bool) -> None:
    """Under ``loom run --groups`` only a strategy that combines the groups may run: any other
    would train each group alone, as if it were the whole job."""
    if in_groups() and not trains_across_groups:
        raise LaunchError(
            f"under `loom run --groups` each group would train alone with {strategy}: use loom.auto_strategy() "
            "(FaultTolerantMirroredStrategy, Mirrored within a group), FaultTolerantShardedStrategy (Sharded within a group) "
            "or FaultTolerantDiLoCoStrategy (DiLoCo across groups); "
            "pipeline, tensor-parallel, parameter-server and other meshes are not replicated across groups"
        )
