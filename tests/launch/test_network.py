"""Two hosts simulated as network namespaces joined by a bridge: cutting one off, and bringing it back.

Each host is a namespace with its own address and hostname (``unshare --uts``); the agents
form one job over the bridge. Skipped, with the reason, where namespaces cannot be made.
"""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import LOOM, ROOT, SCRIPTS, free_port, job_env

TAG = str(os.getpid() % 10_000)
BRIDGE, SUBNET = f"lbr{TAG}", "10.79.0"
HOSTS = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2"}


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


def _why_no_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "iproute2 (ip) or util-linux (unshare) is not installed"
    probe = f"lprobe{TAG}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


REASON = _why_no_namespaces()
if REASON:
    print(f"tests/launch/test_network.py skipped: {REASON}")
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture
def hosts():
    """Namespaces host-a and host-b on one bridge; yields the root-side link of each."""
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "link", "set", BRIDGE, "up")
    links = {}
    try:
        for name, address in HOSTS.items():
            ns, inside, outside = f"l{name}{TAG}", f"l{name}i{TAG}", f"l{name}o{TAG}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", inside, "type", "veth", "peer", "name", outside)
            _sh("ip", "link", "set", inside, "netns", ns)
            _sh("ip", "link", "set", outside, "master", BRIDGE)
            _sh("ip", "link", "set", outside, "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", inside)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", inside, "up")
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            links[name] = outside
        yield links
    finally:
        for name in HOSTS:
            subprocess.run(["ip", "netns", "del", f"l{name}{TAG}"], capture_output=True)
            subprocess.run(["ip", "link", "del", f"l{name}o{TAG}"], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def _agent(host: str, rank: int, port: int, out: Path, epochs: int, *flags: str) -> subprocess.Popen:
    command = [*LOOM, "run", "--nnodes", "2", "--node-rank", str(rank), "--master", f"{HOSTS['a']}:{port}",
               "--nproc", "1", "--timeout", "120", *flags,
               str(SCRIPTS / "fit_resumable.py"), str(out), str(out.parent / "ckpt"), "dataset", str(epochs)]  # fmt: skip
    return subprocess.Popen(
        ["ip", "netns", "exec", f"l{host}{TAG}", "unshare", "--uts", "sh", "-c", f"hostname host-{host} && exec {' '.join(command)}"],
        cwd=ROOT, env=job_env({"LOOM_HEARTBEAT_TIMEOUT": "5"}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip


def _steps(out: Path) -> list[tuple[int, int, int]]:
    progress = out.with_name(out.name + ".progress")
    words = progress.read_text().split() if progress.exists() else []
    return [tuple(map(int, words[i : i + 3])) for i in range(0, len(words) - 2, 3)]  # (attempt, pid, step)


def _wait_for_step(out: Path, step: int, agents: list, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not (_steps(out) and _steps(out)[-1][2] >= step):
        if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
            pytest.fail(f"the two-host job did not reach step {step}: {[e[-1500:] for _, _, e in _outputs(agents, 5)]}")
        time.sleep(0.05)


def _outputs(agents: list, timeout: float) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each agent; a whole process group killed if it outlives ``timeout``."""
    deadline = time.monotonic() + timeout
    results = []
    for agent in agents:
        try:
            agent.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, 9)
        results.append((agent.wait(), *agent.communicate()))
    return results


def test_cutting_a_host_off_fails_fast_naming_it(hosts, tmp_path):
    out, port = tmp_path / "out", free_port()
    agents = [_agent("a", 0, port, out, 30), _agent("b", 1, port, out, 30)]
    _wait_for_step(out, 20, agents)
    cut = time.monotonic()
    _sh("ip", "link", "set", hosts["b"], "down")
    (code_a, _, err_a), (_, _, err_b) = _outputs(agents, timeout=60)
    failed_after = time.monotonic() - cut
    assert code_a != 0
    assert "loom: rank 0 on host-a cannot continue: rank 1 (host-b, pid" in err_a, err_a[-2000:]
    assert "stopped responding (no heartbeat for 5s)" in err_a
    assert failed_after < 30, f"{failed_after:.0f} s: not fast (the collective timeout is 120 s)"
    assert "loom: rank 1 on host-b cannot continue: lost contact with the job's store" in err_b, err_b[-2000:]


def test_with_restarts_the_job_finishes_once_the_host_is_back(hosts, tmp_path):
    out, port = tmp_path / "out", free_port()
    agents = [_agent("a", 0, port, out, 12, "--max-restarts", "3"), _agent("b", 1, port, out, 12, "--max-restarts", "3")]
    _wait_for_step(out, 30, agents)
    _sh("ip", "link", "set", hosts["b"], "down")
    time.sleep(10)  # both sides give up (5 s without a heartbeat) and their agents try to restart
    _sh("ip", "link", "set", hosts["b"], "up")
    (code_a, stdout_a, err_a), (code_b, _, err_b) = _outputs(agents, timeout=120)
    assert (code_a, code_b) == (0, 0), (err_a[-2000:], err_b[-2000:])
    assert "stopped responding" in err_a and "resumed from" in stdout_a
    steps = _steps(out)
    assert steps[-1][2] == 120 and len({attempt for attempt, _, _ in steps}) >= 2  # resumed in a later attempt
