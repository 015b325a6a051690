"""A parameter-server job ends when its chief cannot start: its optimizer (NAdam) is refused.

Before, the other worker waited for variables the chief would never create, and the servers
for that worker. Now every task exits, and each launcher names the chief and why: on one
machine its launcher stops the others at once; with a launcher per task (TF_CONFIG, as across
machines), the chief's launcher tells the servers, which refuse the other worker at once, and
every task ends within seconds, long before the job's timeout. And when the chief's machine is
lost, with no launcher left to tell anyone, the others stop once the job's timeout has passed.
"""

import json
import os
import signal
import socket
import subprocess
import time

from tests.helpers import LOOM, ROOT, SCRIPTS, free_port, job_env, popen

SCRIPT = str(SCRIPTS / "ps_refused.py")
TIMEOUT = 10  # the job's: how long a worker waits for the chief's variables
LONG_TIMEOUT = 300  # a job's timeout that the tasks must not wait for
WITHIN = 60  # seconds every task has, once the chief has failed
LOST_TIMEOUT = 20  # the job's timeout when the chief's machine is lost: the worker's wait for it
REFUSED = "failed: ValueError: NAdam cannot run on the parameter servers; use SGD"


def _ends(procs: list[subprocess.Popen], limit: float) -> list[float]:
    """When each process ended (monotonic); the test fails, killing them, if any outlives ``limit``."""
    ends: dict[int, float] = {}
    deadline = time.monotonic() + limit
    while len(ends) < len(procs):
        for i, proc in enumerate(procs):
            if i not in ends and proc.poll() is not None:
                ends[i] = time.monotonic()
        if time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            raise AssertionError(f"tasks {sorted(set(range(len(procs))) - set(ends))} still ran after {limit}s")
        time.sleep(0.05)
    return [ends[i] for i in range(len(procs))]


def _start(command: list[str], env: dict[str, str], log) -> subprocess.Popen:
    return popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


def test_one_machine_job_stops_when_the_chief_is_refused(tmp_path):
    log, temporary = (tmp_path / "job.log").open("w"), tmp_path / "tmp"
    temporary.mkdir()
    job = _start([*LOOM, "run", "--ps", "1", "--workers", "2", "--timeout", str(TIMEOUT), SCRIPT], job_env({"TMPDIR": str(temporary)}), log)
    _ends([job], limit=150)  # on a loaded machine the start alone takes a while
    output = (tmp_path / "job.log").read_text()
    assert job.returncode == 1, output[-3000:]
    line = output.splitlines()[-1]
    assert line.startswith("loom: job failed: worker 0, the chief (pid ") and REFUSED in line, output[-3000:]
    assert line.endswith("; stopping this job's other tasks here")
    assert output.count("Traceback (most recent call last)") == 1  # the chief's, printed once by its launcher
    assert not list(temporary.glob("loom-ps-*"))  # the state directory the launcher made there, removed


def test_tasks_started_from_tf_config_all_exit_when_the_chief_is_refused(tmp_path):
    cluster = {"ps": [f"127.0.0.1:{free_port()}"], "chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    env = job_env({"LOOM_PS_TOKEN": "shared-by-the-job", "LOOM_TIMEOUT": str(LONG_TIMEOUT)})
    tasks = [("ps", 0), ("chief", 0), ("worker", 0)]
    procs = [
        _start([*LOOM, "run", SCRIPT], {**env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": i}})},
               (tmp_path / f"{kind}.log").open("w"))  # fmt: skip
        for kind, i in tasks
    ]
    ends = _ends(procs, limit=170)
    chief_failed = ends[1]
    assert max(ends) - chief_failed <= WITHIN, f"the last task ended {max(ends) - chief_failed:.0f}s after the chief"
    server, chief, worker = ((tmp_path / f"{kind}.log").read_text() for kind, _ in tasks)
    assert [p.returncode for p in procs] == [1, 1, 1], server[-2000:] + chief[-2000:] + worker[-2000:]
    assert "loom: job failed: worker 0, the chief (pid " in chief and REFUSED in chief.splitlines()[-1], chief[-3000:]
    for log, task in ((worker, "worker 1"), (server, "parameter server 0")):
        line = log.splitlines()[-1]
        assert line.startswith("loom: job failed: worker 0, the chief (pid ") and REFUSED in line, log[-3000:]
        assert line.endswith(f"; {task} stopped"), log[-3000:]
    assert "Traceback" not in worker, worker[-3000:]  # the chief's traceback is in its own launcher's output


def test_a_server_that_cannot_start_ends_the_tasks_of_other_launchers(tmp_path):
    """Server 1's port is taken: its launcher fails the job and tells server 0, which refuses
    worker 1 (waiting for a chief whose machine never came up) at once and then exits."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cluster = {"ps": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{taken.getsockname()[1]}"], "chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
        env = job_env({"LOOM_PS_TOKEN": "shared-by-the-job", "LOOM_TIMEOUT": str(LONG_TIMEOUT)})
        tasks = [("ps", 0), ("worker", 0), ("ps", 1)]  # server 1 last: the others are up by the time it fails
        procs = []
        for kind, i in tasks:
            tf_config = json.dumps({"cluster": cluster, "task": {"type": kind, "index": i}})
            procs.append(_start([*LOOM, "run", SCRIPT], {**env, "TF_CONFIG": tf_config}, (tmp_path / f"{kind}{i}.log").open("w")))
        ends = _ends(procs, limit=170)
    assert max(ends) - ends[2] <= WITHIN, f"the last task ended {max(ends) - ends[2]:.0f}s after server 1"
    server0, worker, server1 = ((tmp_path / f"{kind}{i}.log").read_text() for kind, i in tasks)
    assert [p.returncode for p in procs] == [1, 1, 1], server0[-1500:] + worker[-1500:] + server1[-1500:]
    failed = server1.splitlines()[-1]
    assert failed.startswith("loom: job failed: parameter server 1 (127.0.0.1:") and failed.endswith("exited with code 2"), server1[-2000:]
    assert "the port is in use" in server1
    reason = failed.removeprefix("loom: job failed: ")
    assert worker.splitlines()[-1] == f"loom: job failed: {reason}; worker 1 stopped", worker[-2000:]
    assert server0.splitlines()[-1] == f"loom: job failed: {reason}; parameter server 0 stopped", server0[-2000:]


def test_workers_stop_within_the_timeout_when_the_coordinators_machine_is_lost(tmp_path):
    """The chief's launcher and the chief are killed -9 between two rounds of steps: no one tells
    the servers. The worker, waiting for steps the chief never scheduled, hears that server 0 has
    not heard from the coordinator past the job's timeout, and stops the job in one line."""
    cluster = {"ps": [f"127.0.0.1:{free_port()}"], "chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    env = job_env({"LOOM_PS_TOKEN": "shared-by-the-job", "LOOM_TIMEOUT": str(LOST_TIMEOUT)})
    out = tmp_path / "out"
    tasks = [("ps", 0), ("chief", 0), ("worker", 0)]
    procs = [
        _start([*LOOM, "run", str(SCRIPTS / "ps_coordinator_lost.py"), str(out)],
               {**env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": i}})}, (tmp_path / f"{kind}.log").open("w"))  # fmt: skip
        for kind, i in tasks
    ]
    marker, deadline = out.with_name("out.chief"), time.monotonic() + 150
    try:
        while not marker.exists():
            assert procs[1].poll() is None and time.monotonic() < deadline, (tmp_path / "chief.log").read_text()[-3000:]
            time.sleep(0.05)
        procs[1].kill()  # its launcher, then the chief: as its machine going down
        try:
            os.kill(int(marker.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass  # it died with its launcher already
        lost = time.monotonic()
        ends = _ends([procs[0], procs[2]], limit=LOST_TIMEOUT + WITHIN)
    finally:
        for proc in procs:
            proc.kill()
    assert max(ends) - lost <= LOST_TIMEOUT + WITHIN
    server, worker = (tmp_path / "ps.log").read_text(), (tmp_path / "worker.log").read_text()
    assert [procs[0].returncode, procs[2].returncode] == [1, 1], server[-2000:] + worker[-2000:]
    said = "the coordinator (worker 0, the chief) has not been heard from for"
    assert said in worker.splitlines()[-1] and "past the job's timeout" in worker.splitlines()[-1], worker[-3000:]
    assert "could not reach the servers" not in worker, worker[-3000:]  # they refused its settling: the job had failed
    assert "worker 1 stopped the job: " + said in server.splitlines()[-1], server[-3000:]
