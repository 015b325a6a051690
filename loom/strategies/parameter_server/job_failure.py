"""A job that failed, told to every server, so that its tasks on every machine stop at once.

The launcher of a task that fails the job (the chief failing for good, a server that cannot
come back) sends ``fail`` with one line naming that task and why to every server it did not
start itself. From then on a server refuses every worker's request with that line, so a worker
waiting for the chief's variables, for a round, or at its next step stops at once and its
launcher names the task that failed; the server exits (``JOB_FAILED``) once every worker's
launcher has said its worker is done, or after ``GRACE`` seconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loom.errors import LoomError

if TYPE_CHECKING:
    from loom.strategies.parameter_server.transport import TLS

PREFIX = "the job failed: "
GRACE = 15.0  # seconds a server that was told keeps refusing requests, for workers still to hear it
JOB_FAILED = 4  # a server's exit code: another task failed the job


class JobFailedError(LoomError):
    """Another task failed the job: this one stops."""


def tell_servers(addresses: list[str], token: str, tls: TLS | None, reason: str) -> list[str]:
    """Send ``reason`` (one line) to every server in ``addresses``; the ones that could not be told."""
    from loom.strategies.parameter_server.client import ServerClient

    missed = []
    for address in addresses:
        client = ServerClient(address, token, deadline=5.0, patience=5.0, tls=tls)
        try:
            client.call({"op": "fail", "reason": reason.splitlines()[0] if reason else "unknown"})
        except LoomError:
            missed.append(address)
        finally:
            client.close()
    return missed
