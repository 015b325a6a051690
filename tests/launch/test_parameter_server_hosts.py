"""A parameter-server job across two simulated machines: roles from TF_CONFIG on one, flags on the other.

Host a runs server 0 and the chief, host b server 1 and worker 1, each task its own ``loom run``.
Each server listens on its host's address only; the worker on host b joins late; when both
workers are done the servers exit by themselves. The traffic between the hosts is TLS, made
by the launchers from the job's token alone: a capture of host b's link holds neither the
token nor any message of the wire format in clear. Skipped, with the reason, where network
namespaces cannot be made.

When the chief on host a fails (its optimizer refused), every task on both hosts ends within
a minute, however long the job's timeout, each launcher naming the chief and why, and each
launcher removes the certificate and key it made.
"""

import json
import socket
import subprocess
import threading
import time

import pytest

from tests.helpers import LOOM, ROOT, SCRIPTS, free_port, job_env, read_progress, wait_all
from tests.launch.test_parameter_server_refused import REFUSED, WITHIN, _ends
from tests.netns import network, on_host, why_no_namespaces

HOSTS = {"a": "10.78.0.1", "b": "10.78.0.2"}
REASON = why_no_namespaces()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


class Capture:
    """Every frame crossing a network link, as tcpdump would record it (a raw packet socket)."""

    def __init__(self, link: str) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        self.sock.bind((link, 0))
        self.sock.settimeout(0.2)
        self.frames: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.frames.append(self.sock.recv(1 << 16))
            except TimeoutError:
                continue

    def bytes(self) -> bytes:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()
        return b"".join(self.frames)


def test_servers_and_workers_on_two_machines_train_and_end_together(tmp_path):
    out, steps = tmp_path / "out", 40
    servers = [f"{HOSTS['a']}:{free_port()}", f"{HOSTS['b']}:{free_port()}"]
    tf_config = {"cluster": {"ps": servers, "chief": [f"{HOSTS['a']}:1"], "worker": [f"{HOSTS['b']}:1"]}}
    keys = tmp_path / "tmp"
    keys.mkdir()
    env = job_env({"LOOM_PS_TOKEN": "shared-by-the-job", "TMPDIR": str(keys)})

    def task(host, *flags, tf_task=None):
        command = [*LOOM, "run", *flags, str(SCRIPTS / "ps_train.py"), str(out), str(steps)]
        task_env = {**env, "TF_CONFIG": json.dumps({**tf_config, "task": tf_task})} if tf_task else env
        return subprocess.Popen(on_host(host, command, prefix="p"), cwd=ROOT, env=task_env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip

    flags = ["--ps-hosts", ",".join(servers), "--workers", "2"]
    with network(HOSTS, prefix="p") as links:
        capture = Capture(links["b"])
        tasks = [
            task("a", tf_task={"type": "ps", "index": 0}),
            task("b", *flags, "--role", "ps", "--index", "1"),
            task("a", tf_task={"type": "chief", "index": 0}),
        ]
        deadline = time.monotonic() + 90
        while len(read_progress(out)) < 10:  # the chief trains alone for a while
            assert time.monotonic() < deadline and all(t.poll() is None for t in tasks), wait_all(tasks, 5)
            time.sleep(0.05)
        assert len(list(keys.glob("loom-ps-tls-*"))) == 3  # each running launcher's certificate and key, in TMPDIR
        tasks.append(task("b", *flags, "--role", "worker", "--index", "1"))
        results = wait_all(tasks, timeout=120)
        wire = capture.bytes()
    for code, _, err in results:
        assert code == 0, err[-3000:]
    (_, out_a, _), (_, out_b, _) = results[:2]
    assert f"parameter server 0 listening on {servers[0]} with TLS" in out_a and f"parameter server 1 listening on {servers[1]} with TLS" in out_b
    assert len(wire) > 100_000 and wire.count(b"\x17\x03\x03") > 100  # the job's traffic, in TLS records
    assert b"shared-by-the-job" not in wire  # the token
    assert b'"fields"' not in wire and b"grad/" not in wire  # any request's header, or a pushed gradient's name
    assert all("every worker has finished; exiting" in stdout for _, stdout, _ in results[:2])
    assert not list(keys.glob("loom-ps-*"))  # each launcher's certificate and key, and its servers' temporary state, removed
    progress = read_progress(out)
    assert {w: max(s for v, _, s in progress if v == w) for w in (0, 1)} == {0: steps, 1: steps}
    assert min(i for i, (w, _, _) in enumerate(progress) if w == 1) >= 10  # worker 1 joined a running job
    for stats in json.loads(out.with_name("out.stats").read_text()):  # each server: every push once
        assert sorted(stats["applied"].values()) == [steps, steps], stats


def test_a_chief_refused_on_one_machine_ends_every_task_on_both_and_their_keys(tmp_path):
    servers = [f"{HOSTS['a']}:{free_port()}", f"{HOSTS['b']}:{free_port()}"]
    cluster = {"ps": servers, "chief": [f"{HOSTS['a']}:1"], "worker": [f"{HOSTS['b']}:1"]}
    keys = tmp_path / "tmp"
    keys.mkdir()
    env = job_env({"LOOM_PS_TOKEN": "shared-by-the-job", "LOOM_TIMEOUT": "300", "TMPDIR": str(keys)})
    tasks = [("a", "ps", 0), ("b", "ps", 1), ("a", "chief", 0), ("b", "worker", 0)]
    logs = [tmp_path / f"{kind}-{i}.log" for _, kind, i in tasks]
    with network(HOSTS, prefix="q"):
        procs = [
            subprocess.Popen(on_host(host, [*LOOM, "run", str(SCRIPTS / "ps_refused.py")], prefix="q"), cwd=ROOT,
                             env={**env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": i}})},
                             stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for (host, kind, i), log in zip(tasks, logs)
        ]  # fmt: skip
        ends = _ends(procs, limit=200)
    assert max(ends) - ends[2] <= WITHIN, f"the last task ended {max(ends) - ends[2]:.0f}s after the chief"
    outputs = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [1, 1, 1, 1], "\n".join(o[-1500:] for o in outputs)
    for output, task in zip(outputs, ["parameter server 0", "parameter server 1", None, "worker 1"]):
        line = output.splitlines()[-1]
        assert line.startswith("loom: job failed: worker 0, the chief (pid ") and " on host-a), " in line and REFUSED in line, output[-3000:]
        assert task is None or line.endswith(f"; {task} stopped"), output[-3000:]
    assert all("with TLS" in output for output in outputs[:2]), outputs[0][-1500:]  # each launcher made a certificate
    assert not list(keys.glob("loom-ps-*"))  # in TMPDIR (see the test above), and removed with the servers' temporary state
