"""Errors a person can act on: each message says what is wrong and what to do."""


class LoomError(Exception):
    """Base class of every error loom raises on purpose."""


class ClusterError(LoomError):
    """The job's cluster description (env, TF_CONFIG, Slurm, flags) is wrong or inconsistent."""


class LaunchError(LoomError):
    """A job could not be started: a port in use, too many processes for the devices, ..."""


class RankFailureError(LoomError):
    """Another rank of the job died or stopped responding, so this one cannot go on.

    A process stopping for this reason exits with ``EXIT_CODE`` (EX_TEMPFAIL), so the launcher
    can tell the rank that failed first from the ranks that stopped because of it.
    """

    EXIT_CODE = 75


class DataFileError(LoomError):
    """An input file is missing, unreadable or corrupt; the message names it."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(
            f"{path}: {reason}. Fix or remove the file, or pass errors='skip' to skip unreadable samples"
        )
        self.path = path
        self.reason = reason

    def __reduce__(self):  # keeps (path, reason) across process workers
        return type(self), (self.path, self.reason)


class CheckpointError(LoomError):
    """A checkpoint is missing, incomplete, corrupt, or does not match what it is loaded into."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint is readable but holds other keys or shapes than what it is loaded into."""
