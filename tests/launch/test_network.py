"""Two hosts simulated as network namespaces joined by a bridge: cutting one off, and bringing it back.

Each host is a namespace with its own address and hostname (``unshare --uts``); the agents
form one job over the bridge. Skipped, with the reason, where namespaces cannot be made.
"""

import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import LOOM, ROOT, SCRIPTS, free_port, job_env, read_progress, wait_all
from tests.netns import network, on_host, sh, why_no_namespaces

HOSTS = {"a": "10.79.0.1", "b": "10.79.0.2"}
REASON = why_no_namespaces()
if REASON:
    print(f"tests/launch/test_network.py skipped: {REASON}")
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture
def hosts():
    """Namespaces host-a and host-b on one bridge; yields the root-side link of each."""
    with network(HOSTS) as links:
        yield links


def _agent(host: str, rank: int, port: int, out: Path, epochs: int, *flags: str) -> subprocess.Popen:
    """Host ``host``'s agent; its stderr goes to ``OUT.<host>.err`` as well, to be read while it runs."""
    command = [*LOOM, "run", "--nnodes", "2", "--node-rank", str(rank), "--master", f"{HOSTS['a']}:{port}",
               "--nproc", "1", "--timeout", "120", *flags,
               str(SCRIPTS / "fit_resumable.py"), str(out), str(out.parent / "ckpt"), "dataset", str(epochs)]  # fmt: skip
    tee = ["bash", "-c", f'"$@" 2> >(tee {out}.{host}.err >&2)', "agent", *on_host(host, command)]
    return subprocess.Popen(
        tee, cwd=ROOT, env=job_env({"LOOM_HEARTBEAT_TIMEOUT": "5"}),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def _wait_for_lines(out: Path, said: dict[str, str], agents: list, timeout: float = 60) -> None:
    """Until each host's agent has said its line (``said``: host -> text)."""
    deadline = time.monotonic() + timeout
    while not all(text in _said(out, host) for host, text in said.items()):
        if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
            pytest.fail(f"the agents did not say {said}: {[_said(out, h)[-1500:] for h in HOSTS]}")
        time.sleep(0.05)


def _said(out: Path, host: str) -> str:
    path = Path(f"{out}.{host}.err")
    return path.read_text() if path.exists() else ""


def _wait_for_step(out: Path, step: int, agents: list, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not (read_progress(out) and read_progress(out)[-1][2] >= step):
        if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
            pytest.fail(f"the two-host job did not reach step {step}: {[e[-1500:] for _, _, e in wait_all(agents, 5)]}")
        time.sleep(0.05)


def test_cutting_a_host_off_fails_fast_naming_it(hosts, tmp_path):
    out, port = tmp_path / "out", free_port()
    agents = [_agent("a", 0, port, out, 30), _agent("b", 1, port, out, 30)]
    _wait_for_step(out, 20, agents)
    cut = time.monotonic()
    sh("ip", "link", "set", hosts["b"], "down")
    (code_a, _, err_a), (_, _, err_b) = wait_all(agents, timeout=60)
    failed_after = time.monotonic() - cut
    assert code_a != 0
    assert "loom: rank 0 on host-a cannot continue: rank 1 (host-b, pid" in err_a, err_a[-2000:]
    assert "stopped responding (no heartbeat for 5s)" in err_a
    assert failed_after < 30, f"{failed_after:.0f} s: not fast (the collective timeout is 120 s)"
    assert "loom: rank 1 on host-b cannot continue: lost contact with the job's store" in err_b, err_b[-2000:]


def test_with_restarts_the_job_finishes_once_the_host_is_back(hosts, tmp_path):
    out, port = tmp_path / "out", free_port()
    agents = [_agent("a", 0, port, out, 6, "--max-restarts", "3"), _agent("b", 1, port, out, 6, "--max-restarts", "3")]
    _wait_for_step(out, 20, agents)
    sh("ip", "link", "set", hosts["b"], "down")
    # Both sides give up (5 s without a heartbeat) and their agents restart their workers.
    _wait_for_lines(out, {"a": "restart 1 of 3", "b": "restart 1 of 3"}, agents)
    sh("ip", "link", "set", hosts["b"], "up")
    (code_a, stdout_a, err_a), (code_b, _, err_b) = wait_all(agents, timeout=120)
    assert (code_a, code_b) == (0, 0), (err_a[-2000:], err_b[-2000:])
    assert "stopped responding" in err_a and "resumed from" in stdout_a
    steps = read_progress(out)
    assert steps[-1][2] == 60 and len({attempt for attempt, _, _ in steps}) >= 2  # resumed in a later attempt


@pytest.mark.timeout(120)
def test_a_one_host_job_runs_where_the_hosts_own_name_does_not_resolve(hosts, tmp_path):
    """torchrun would hand the workers this host's name as MASTER_ADDR, which they cannot connect to."""
    script = tmp_path / "sum.py"
    script.write_text("import os, sys, torch, torch.distributed as dist, loom\n"
                      "s = loom.MirroredStrategy()\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                      "open(f'{sys.argv[1]}/rank{s.replica_id}', 'w').write(f\"{os.environ['MASTER_ADDR']} {int(t.item())}\")\n")  # fmt: skip
    done = subprocess.run(on_host("a", [*LOOM, "run", "--nproc", "2", str(script), str(tmp_path)]), cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["127.0.0.1 2"] * 2
