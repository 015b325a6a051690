"""How the launcher words failed ranks: each distinct traceback once, ranks failing alike together."""

import json
import signal
import socket

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from loom.errors import RankFailureError
from loom.launch.failures import cause, report

HOST = socket.gethostname()


def failure(tmp_path, rank: int, exitcode: int, exception: str | None = None, at: int = 100) -> ProcessFailure:
    """A rank's failure as torchrun's agent reads it, with the error file a loom worker writes."""
    path = tmp_path / f"error-{rank}.json"
    if exception is not None:
        stack = f"Traceback (most recent call last):\n  File \"train.py\", line {rank}, in main\n{exception}\n"
        path.write_text(json.dumps({"message": {"message": exception, "extraInfo": {"py_callstack": stack, "timestamp": str(at)}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_ranks_failing_alike_print_one_traceback_and_one_line(tmp_path):
    failures = {r: failure(tmp_path, r, 1, "TypeError: bad operand") for r in range(4)}
    text = report(failures, world_size=4, headline="job failed")
    assert text.count("Traceback (most recent call last)") == 1
    assert text.splitlines()[-1] == "loom: job failed: all 4 ranks failed: TypeError: bad operand"


def test_ranks_failing_differently_are_each_named(tmp_path):
    failures = {
        0: failure(tmp_path, 0, RankFailureError.EXIT_CODE),
        1: failure(tmp_path, 1, 1, "ValueError: bad shape", at=100),
        2: failure(tmp_path, 2, -signal.SIGTERM),
        3: failure(tmp_path, 3, 1, "KeyError: 'lr'", at=101),
    }
    text = report(failures, world_size=4, headline="job failed")
    assert text.count("Traceback (most recent call last)") == 2
    assert text.splitlines()[-1] == (
        f"loom: job failed: rank 1 on {HOST} (pid 1001) failed: ValueError: bad shape; "
        f"rank 3 on {HOST} (pid 1003) failed: KeyError: 'lr'; rank(s) 0, 2 stopped because of them"
    )


def test_some_ranks_failing_alike_share_a_clause(tmp_path):
    failures = {r: failure(tmp_path, r, -signal.SIGKILL) for r in (1, 2)}
    failures[0] = failure(tmp_path, 0, RankFailureError.EXIT_CODE)
    assert cause(failures, world_size=8) == f"ranks 1, 2 on {HOST} were killed by SIGKILL; rank(s) 0 stopped because of it"


def test_a_rank_killed_alone_is_the_cause_even_by_sigterm(tmp_path):
    assert cause({0: failure(tmp_path, 0, -signal.SIGTERM)}, world_size=1) == f"rank 0 on {HOST} (pid 1000) was killed by SIGTERM"


def test_a_hung_rank_the_agent_had_to_kill_is_named_as_stopped_by_loom_for_the_hang(tmp_path):
    survivor, stuck = failure(tmp_path, 0, RankFailureError.EXIT_CODE), failure(tmp_path, 1, -signal.SIGKILL)
    stuck.timestamp = survivor.timestamp + 30  # the agent's SIGTERM waited for it in vain
    hung = {1: "stopped responding (no heartbeat for 30s)"}
    assert cause({0: survivor, 1: stuck}, world_size=2, hung=hung) == (
        f"rank 1 on {HOST} (pid 1001) stopped responding (no heartbeat for 30s), and loom stopped it for the hang (SIGKILL); "
        "rank(s) 0 stopped because of it"
    )
    stuck.timestamp = survivor.timestamp  # killed at once: not the agent's kill after its SIGTERM
    assert cause({0: survivor, 1: stuck}, world_size=2, hung=hung) == f"rank 1 on {HOST} (pid 1001) was killed by SIGKILL; rank(s) 0 stopped because of it"
