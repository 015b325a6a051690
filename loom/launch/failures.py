"""What the launcher says when workers fail: each distinct traceback once, then one line.

Workers started by ``loom run`` hand their exception to torchrun's agent through its error
file (``loom.launch.worker``) instead of printing it, so that four ranks failing the same way
print one traceback, not four. Ranks that exited because another one failed
(``RankFailureError.EXIT_CODE``, or the agent's SIGTERM) are not causes, even when they
exited first (a stuck rank is the last to go), nor is a rank killed by SIGKILL once the agent's
SIGTERM has waited for it in vain, unless the others named it hung: then it is the cause, and
the agent's kill is said to be loom's, for the hang.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Mapping

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from loom.comm.hangs import aborted
from loom.comm.health import FAULT_DUMP_ENV, fault_path
from loom.comm.stacks import aborted_in
from loom.errors import RankFailureError

# How a rank ends when the agent stops it because another one failed.
STOPPED = {RankFailureError.EXIT_CODE, -signal.SIGTERM, 128 + signal.SIGTERM}
# torch's agent kills a rank that its SIGTERM has not ended within 30 s (``PContext.close``);
# a failure's timestamp is in whole seconds.
_SIGKILL_AFTER = 30 - 1


def _stopped(failure: ProcessFailure, first_failure: int) -> bool:
    """Whether the rank ended the way a rank the agent stops does (``first_failure``: when the first rank failed)."""
    late = failure.timestamp - first_failure >= _SIGKILL_AFTER
    return failure.exitcode in STOPPED or (failure.exitcode == -signal.SIGKILL and late)


def exception_of(failure: ProcessFailure) -> tuple[str, str] | None:
    """(exception line, traceback) a worker recorded in its error file; None if it left none."""
    data = failure.error_file_data.get("message")
    if not isinstance(data, dict) or not data.get("message"):
        return None
    return data["message"], data.get("extraInfo", {}).get("py_callstack", "")


def fault_dump(rank: int) -> str:
    """The Python stacks a worker ended by a signal left (``HealthMonitor`` has ``faulthandler`` write them
    where this launcher's agent said); "" if none."""
    try:
        with open(fault_path(os.environ[FAULT_DUMP_ENV], rank)) as f:
            return f.read()
    except (KeyError, OSError):
        return ""


def _what(rank: int, failure: ProcessFailure, plural: bool, hung: Mapping[int, str]) -> str:
    if rank in hung:
        return f"{hung[rank]}, and loom stopped {'them' if plural else 'it'} for the hang ({failure.signal_name()})"
    exception = exception_of(failure)
    if exception is not None:
        return f"failed: {exception[0]}"
    if failure.exitcode < 0:
        position = aborted_in(fault_dump(rank))
        if position is not None and not plural:  # gloo aborts a rank whose collective does not match the others'
            site, why = aborted(position)
            return f"was killed by {failure.signal_name()} in {site}: {why}"
        return f"{'were' if plural else 'was'} killed by {failure.signal_name()}"
    return f"exited with code {failure.exitcode}"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def tracebacks(failures: Mapping[int, ProcessFailure]) -> list[str]:
    """Each distinct exception's traceback once, in the order the ranks failed."""
    seen: dict[str, str] = {}
    for _, failure in sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0])):
        exception = exception_of(failure)
        if exception is not None and exception[1]:
            seen.setdefault(exception[0], exception[1])
    return list(seen.values())


def cause(failures: Mapping[int, ProcessFailure], world_size: int, hung: Mapping[int, str] | None = None) -> str:
    """Which ranks failed and how, as one sentence; ranks failing the same way share a clause.

    ``all 4 ranks failed: TypeError: ...`` when every rank of the job failed alike;
    otherwise each way of failing is named with its ranks, and the ranks that stopped
    because of them are listed last. ``hung``: ranks the others named hung, with how
    (``stopped responding (no heartbeat for 30s)``); one the agent had to kill is the cause.
    """
    first = min(f.timestamp for f in failures.values())
    killed = {r: how for r, how in (hung or {}).items() if r in failures and failures[r].exitcode == -signal.SIGKILL and _stopped(failures[r], first)}
    causes = {r: f for r, f in failures.items() if exception_of(f) is not None or not _stopped(f, first) or r in killed}
    causes = causes or dict(failures)
    groups: dict[str, list[int]] = {}
    for rank, failure in sorted(causes.items(), key=lambda item: (item[1].timestamp, item[0])):
        groups.setdefault(_what(rank, failure, plural=False, hung=killed), []).append(rank)
    host = socket.gethostname()
    clauses = []
    for what, ranks in groups.items():
        if len(ranks) == 1:
            clauses.append(f"rank {ranks[0]} on {host} (pid {causes[ranks[0]].pid}) {what}")
        elif len(ranks) == world_size:
            clauses.append(f"all {world_size} ranks {_what(ranks[0], causes[ranks[0]], plural=True, hung=killed)}")
        else:
            clauses.append(f"ranks {_ranks(ranks)} on {host} {_what(ranks[0], causes[ranks[0]], plural=True, hung=killed)}")
    stopped = sorted(set(failures) - set(causes))
    if stopped:
        clauses.append(f"rank(s) {_ranks(stopped)} stopped because of {'it' if len(groups) == 1 else 'them'}")
    return "; ".join(clauses)


def report(failures: Mapping[int, ProcessFailure], world_size: int, headline: str, hung: Mapping[int, str] | None = None) -> str:
    """The tracebacks, then ``loom: HEADLINE: cause`` (``hung``: as ``cause`` takes it)."""
    return "".join(tracebacks(failures)) + f"loom: {headline}: {cause(failures, world_size, hung)}"
