"""A dead or stuck rank is named within the timeout; jobs that succeed exit cleanly."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from loom.launch.failures import cause
from tests.helpers import LOOM, ROOT, SCRIPTS, free_port, job_env, loom_run, popen

KILL_SCRIPT = str(SCRIPTS / "train_until_killed.py")


def start_training(pid_dir: Path, timeout: float) -> subprocess.Popen:
    return popen(
        [*LOOM, "run", "--nproc", "4", "--timeout", str(timeout), KILL_SCRIPT, str(pid_dir)],
        cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for_pids(pid_dir: Path, job: subprocess.Popen, deadline: float = 60) -> dict[int, int]:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        files = list(pid_dir.glob("rank*.pid"))
        if len(files) == 4 and all(f.read_text() for f in files):
            return {int(f.stem[4:]): int(f.read_text()) for f in files}
        assert job.poll() is None, job.communicate()[1]
        time.sleep(0.2)
    job.kill()
    pytest.fail(f"the job did not start training within {deadline}s")


def test_kill_9_of_one_rank_names_it_everywhere(tmp_path):
    timeout = 20
    job = start_training(tmp_path, timeout)
    pids = wait_for_pids(tmp_path, job)
    killed_at = time.monotonic()
    os.kill(pids[2], signal.SIGKILL)
    try:
        _, err = job.communicate(timeout=timeout + 15)
    finally:
        job.kill()
    assert time.monotonic() - killed_at < timeout
    assert job.returncode != 0
    for survivor in (0, 1, 3):
        assert f"loom: rank {survivor} on " in err and "cannot continue: rank 2 (" in err, err
    assert "loom: job failed: rank 2 on" in err and "was killed by SIGKILL; rank(s) 0, 1, 3 stopped because of it" in err


def test_stuck_rank_is_named_within_the_timeout_and_last_as_stopped_by_loom(tmp_path):
    timeout = 10  # the survivors' heartbeat checks must conclude before it, on a machine two CPU hogs share with the suite
    job = start_training(tmp_path, timeout)
    pids = wait_for_pids(tmp_path, job)
    os.kill(pids[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    survivors: set[int] = set()
    said: list[str] = []
    try:
        while len(survivors) < 3:  # read the survivors' verdicts as they come
            line = job.stderr.readline()
            said.append(line)
            assert line, "the job ended before every survivor named the stuck rank:\n" + "".join(said)[-3000:]
            if "cannot continue: rank 1 (" in line and "stopped responding" in line:
                survivors.add(int(line.split("loom: rank ")[1].split()[0]))
        assert time.monotonic() - stopped_at < timeout + 10
        assert survivors == {0, 2, 3}
        _, err = job.communicate(timeout=90)  # the agent's SIGTERM cannot end a stopped rank: it kills it 30 s later
    finally:
        job.kill()
        with contextlib.suppress(ProcessLookupError):  # gone already, unless the test failed
            os.kill(pids[1], signal.SIGKILL)
    assert job.returncode != 0
    # It used to end "rank 1 ... was killed by SIGKILL": the agent's own kill, read as the cause.
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"loom: job failed: rank 1 on {re.escape(socket.gethostname())} \(pid {pids[1]}\) stopped responding \(no heartbeat for [\d.]+s\), "
        r"and loom stopped it for the hang \(SIGKILL\); rank\(s\) 0, 2, 3 stopped because of it",
        last,
    ), err[-2000:]


def test_repeated_launches_exit_cleanly():
    for attempt in range(2):
        done = loom_run(["run", "--nproc", "4", str(SCRIPTS / "teardown_job.py")], timeout=60)
        assert done.returncode == 0, f"launch {attempt}: {done.stderr}"
        assert "terminate called" not in done.stderr, f"launch {attempt} aborted at teardown: {done.stderr}"


def test_port_in_use_is_one_clear_line():
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("", port))
        holder.listen()
        done = loom_run(["run", "--nnodes", "2", "--node-rank", "0", "--master", f"127.0.0.1:{port}", "--nproc", "1", "x.py"], timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"loom: error: port {port} on 127.0.0.1 is already in use (another job?); "
        f"pass a free one with --master 127.0.0.1:PORT, or stop the process holding it"
    )


def test_malformed_tf_config_is_one_clear_line():
    done = loom_run(["run", "x.py"], env={"TF_CONFIG": "{\"cluster\": "}, timeout=30)
    assert done.returncode == 2
    assert done.stderr.startswith("loom: error: TF_CONFIG is not valid JSON (Expecting value at char 12)")
    assert len(done.stderr.strip().splitlines()) == 1


def test_user_error_on_one_rank_is_reported_by_the_others(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        "import torch, loom\n"
        "def main():\n"
        "    s = loom.MirroredStrategy()\n"
        "    if s.replica_id == 1:\n"
        "        raise ValueError('bad shape in rank one')\n"
        "    s.barrier()\n"
        "loom.launch(main)\n"
    )
    done = loom_run(["run", "--nproc", "2", "--timeout", "20", str(script)], timeout=60)
    assert done.returncode != 0
    assert "ValueError: bad shape in rank one" in done.stderr
    assert "loom: job failed: rank 1 on" in done.stderr


def test_the_failing_rank_keeps_its_own_story_when_the_agent_stops_it_midway(tmp_path):
    # Rank 1 stops (as a victim does) while rank 0 is still formatting its error: the agent's
    # SIGTERM reaches rank 0 then, and must neither cut its record short nor relabel it a victim.
    script = tmp_path / "slow_error.py"
    script.write_text(
        "import os, time, loom\n"
        "class SlowError(Exception):\n"
        "    slow = True\n"
        "    def __str__(self):  # slow the first time only: the hooks format it several times\n"
        "        if SlowError.slow:\n"
        "            SlowError.slow = False\n"
        "            time.sleep(3)\n"
        "        return 'slow to say'\n"
        "def main():\n"
        "    s = loom.MirroredStrategy()\n"
        "    s.barrier()\n"
        "    if s.replica_id == 1:\n"
        "        time.sleep(1)\n"
        "        os._exit(75)\n"
        "    raise SlowError()\n"
        "loom.launch(main)\n"
    )
    done = loom_run(["run", "--nproc", "2", "--timeout", "20", str(script)], timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1].endswith("failed: SlowError: slow to say; rank(s) 1 stopped because of it"), done.stderr


def test_ranks_failing_alike_print_the_traceback_once(tmp_path):
    script = tmp_path / "all_fail.py"
    script.write_text(
        "import signal, loom\n"
        "def main():\n"
        "    s = loom.MirroredStrategy()\n"
        "    s.barrier()\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # every rank gets to fail, whenever the agent looks\n"
        "    s.barrier()\n"
        "    None + 1\n"
        "loom.launch(main)\n"
    )
    done = loom_run(["run", "--nproc", "3", "--timeout", "20", str(script)], timeout=90)
    assert done.returncode == 1
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr
    assert done.stderr.count("TypeError: unsupported operand") == 2, done.stderr  # the traceback's, the summary's
    assert done.stderr.splitlines()[-1] == "loom: job failed: all 3 ranks failed: TypeError: unsupported operand type(s) for +: 'NoneType' and 'int'"


def test_each_restart_is_announced_with_its_cause(tmp_path):
    script = tmp_path / "fails_once.py"
    script.write_text(
        "import os, time\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise ValueError('the first attempt fails')\n"
        "    time.sleep(60)  # until the agent stops it\n"
    )
    done = loom_run(["run", "--nproc", "2", "--max-restarts", "2", str(script)], timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("Traceback (most recent call last)") == 1, done.stderr
    notice = [line for line in done.stderr.splitlines() if line.startswith("loom: restart")]
    assert len(notice) == 1 and notice[0].startswith(f"loom: restart 1 of 2: rank 1 on {socket.gethostname()} (pid "), done.stderr
    assert notice[0].endswith(") failed: ValueError: the first attempt fails; rank(s) 0 stopped because of it")


def test_sigterm_to_the_launcher_is_one_line(tmp_path):
    script = tmp_path / "waits.py"
    script.write_text(f"import os, pathlib, time\npathlib.Path({str(tmp_path / 'pid')!r}).write_text(str(os.getpid()))\ntime.sleep(60)\n")
    job = popen([*LOOM, "run", "--nproc", "1", str(script)], cwd=ROOT, env=job_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
            assert job.poll() is None and time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.2)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=30)
    finally:
        job.kill()
    assert "Traceback" not in err, err
    assert err.splitlines()[-1] == "loom: stopped by SIGTERM; workers terminated"
    assert job.returncode == 128 + signal.SIGTERM
    assert not Path(f"/proc/{int((tmp_path / 'pid').read_text())}").exists()


def test_a_rank_the_agent_killed_after_its_sigterm_is_not_called_a_cause(tmp_path):
    # A survivor whose main thread waits in C++ cannot run its SIGTERM handler: 30 s later the
    # agent kills it, and it used to read "all 2 ranks were killed by SIGKILL".
    killed, stopped = (ProcessFailure(local_rank=r, pid=1000 + r, exitcode=-signal.SIGKILL, error_file=str(tmp_path / f"e{r}")) for r in (1, 0))
    killed.timestamp, stopped.timestamp = 100, 130
    assert cause({0: stopped, 1: killed}, world_size=2) == f"rank 1 on {socket.gethostname()} (pid 1001) was killed by SIGKILL; rank(s) 0 stopped because of it"
