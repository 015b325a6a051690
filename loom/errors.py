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
