"""How the launcher words failed ranks: each distinct traceback once, ranks failing alike together."""

import json
import signal
import socket
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from loom.comm.health import PREFIX
from loom.errors import RankFailureError
from loom.launch.agent import HangStops
from loom.launch.failures import cause, killed_after_sigterm, report
from tests.helpers import free_port

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
    hung = {1: "stopped responding (no heartbeat for 30s)"}
    assert cause({0: survivor, 1: stuck}, world_size=2, hung=hung) == (
        f"rank 1 on {HOST} (pid 1001) stopped responding (no heartbeat for 30s), and loom stopped it for the hang (SIGKILL); "
        "rank(s) 0 stopped because of it"
    )
    assert cause({0: survivor, 1: stuck}, world_size=2) == f"rank 1 on {HOST} (pid 1001) was killed by SIGKILL; rank(s) 0 stopped because of it"


def test_only_a_late_sigkill_is_torchs_agents_kill_after_its_sigterm(tmp_path):
    survivor, stuck = failure(tmp_path, 0, RankFailureError.EXIT_CODE), failure(tmp_path, 1, -signal.SIGKILL)
    assert not killed_after_sigterm(stuck, survivor.timestamp)  # killed at once: by someone else
    stuck.timestamp = survivor.timestamp + 30  # the agent's SIGTERM waited for it in vain
    assert killed_after_sigterm(stuck, survivor.timestamp)
    assert not killed_after_sigterm(survivor, survivor.timestamp)


def test_a_worker_named_hung_is_stopped_by_sigkill_and_recorded_the_others_by_sigterm():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    store.set(f"{PREFIX}/1/hung/3", "stopped responding (no heartbeat for 5s)")
    stops = HangStops()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "1"}
    assert stops.signal_for({**env, "RANK": "3"}, signal.SIGTERM) == signal.SIGKILL
    assert stops.signal_for({**env, "RANK": "2"}, signal.SIGTERM) == signal.SIGTERM
    assert stops.signal_for({**env, "RANK": "3", "TORCHELASTIC_RESTART_COUNT": "0"}, signal.SIGTERM) == signal.SIGTERM  # another attempt's
    assert stops.signal_for({**env, "RANK": "3"}, signal.SIGKILL) == signal.SIGKILL
    assert stops.killed == {3: "stopped responding (no heartbeat for 5s)"}
    stops.new_attempt()
    assert stops.killed == {}


def test_a_store_that_is_gone_stops_every_worker_by_sigterm_after_one_quick_try():
    stops = HangStops()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "TORCHELASTIC_RESTART_COUNT": "0"}
    started = time.monotonic()
    assert [stops.signal_for({**env, "RANK": str(r)}, signal.SIGTERM) for r in range(4)] == [signal.SIGTERM] * 4
    assert time.monotonic() - started < 3 and stops.killed == {}
