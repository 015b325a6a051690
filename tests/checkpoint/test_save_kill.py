"""A rank killed in the middle of a save is named, by rank and host, within seconds: the job's
first save too, whose survivors wait in C++ for the checkpoint's process group (there they
used to be stopped only by the heartbeat's 30 s silence, or by the agent's SIGKILL)."""

import os
import signal
import socket
import subprocess
import time

from tests.helpers import LOOM, ROOT, SCRIPTS, job_env, popen


def test_a_rank_killed_in_the_first_save_is_named_within_5_s(tmp_path):
    job = popen(
        [*LOOM, "run", "--nproc", "2", "--threads", "1", str(SCRIPTS / "first_save_kill.py"), str(tmp_path)],
        cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    pid_file, host = tmp_path / "rank1.pid", socket.gethostname()
    try:
        deadline = time.monotonic() + 90
        while not (pid_file.exists() and pid_file.read_text()):
            assert job.poll() is None and time.monotonic() < deadline, "rank 1 did not reach its save"
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        survivor = f"loom: rank 0 on {host} cannot continue: rank 1 ({host}, pid {pid}) died"
        lines = []
        while survivor not in lines:
            line = job.stderr.readline()
            assert line, f"the job ended without the survivor's line: {''.join(lines)}"
            lines.append(line.rstrip("\n"))
        named_after = time.monotonic() - killed_at
        _, rest = job.communicate(timeout=60)
    finally:
        job.kill()
    assert named_after < 5, f"rank 1 was named {named_after:.1f}s after it was killed"
    assert job.returncode != 0
    final = (lines + rest.splitlines())[-1]
    assert final == f"loom: job failed: rank 1 on {host} (pid {pid}) was killed by SIGKILL; rank(s) 0 stopped because of it", final
