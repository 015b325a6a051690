"""A rank killed on another host is named by rank and host within seconds: its agent tells the
others' heartbeats, which no longer wait for LOOM_HEARTBEAT_TIMEOUT of silence (30 s).

Two hosts simulated as network namespaces (``tests/netns.py``); skipped, with the reason,
where namespaces cannot be made.
"""

import os
import signal
import subprocess
import time

import pytest

from tests.helpers import LOOM, ROOT, SCRIPTS, free_port, job_env, wait_all
from tests.netns import network, on_host, why_no_namespaces

HOSTS = {"a": "10.79.1.1", "b": "10.79.1.2"}
REASON = why_no_namespaces()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def test_a_rank_killed_on_another_host_in_the_first_save_is_named_within_5_s(tmp_path):
    port = free_port()
    with network(HOSTS, prefix="d"):
        agents = [
            subprocess.Popen(
                on_host(host, [*LOOM, "run", "--nnodes", "2", "--node-rank", str(rank), "--master", f"{HOSTS['a']}:{port}",
                               "--nproc", "1", "--threads", "1", str(SCRIPTS / "first_save_kill.py"), str(tmp_path)], prefix="d"),
                cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            )
            for rank, host in enumerate(HOSTS)
        ]  # fmt: skip
        pid_file = tmp_path / "rank1.pid"
        deadline = time.monotonic() + 90
        while not (pid_file.exists() and pid_file.read_text()):
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                pytest.fail(f"rank 1 did not reach its save: {[e[-1500:] for _, _, e in wait_all(agents, 5)]}")
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGKILL)  # the namespaces share this pid space
        killed = time.monotonic()
        line, lines = f"loom: rank 0 on host-a cannot continue: rank 1 (host-b, pid {pid}) died (killed by SIGKILL)", []
        while line not in lines:
            text = agents[0].stderr.readline()
            if not text:
                pytest.fail(f"host-a's agent ended without naming rank 1: {''.join(lines)}")
            lines.append(text.rstrip("\n"))
        named_after = time.monotonic() - killed
        (code_a, _, _), (code_b, _, err_b) = wait_all(agents, timeout=60)
    assert named_after < 5, f"named {named_after:.1f}s after the kill"
    assert code_a != 0 and code_b != 0
    assert err_b.strip().splitlines()[-1] == f"loom: job failed: rank 1 on host-b (pid {pid}) was killed by SIGKILL", err_b[-2000:]
