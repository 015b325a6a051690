"""A parameter server against callers from outside the job: refused before their requests are read."""

import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from loom.strategies.parameter_server.service import METHOD, SERVICE
from tests.helpers import ROOT, free_port, job_env

MIB = 1 << 20


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.fixture
def server_process():
    """A parameter server in its own process (``serve.py``), so its memory is its own."""
    port = free_port()
    command = [sys.executable, "-m", "loom.strategies.parameter_server.serve", "--port", str(port)]
    proc = subprocess.Popen(command, env=job_env({"LOOM_PS_TOKEN": "the-job"}), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in proc.stdout.readline()
        yield proc, f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_large_requests_without_the_token_are_refused_unread(server_process):
    """Four concurrent 200 MiB requests without the token: each refused, and the server's peak
    memory grows by far less than one of them (it grew by all four when the token was checked
    after the body had been received)."""
    proc, address = server_process
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 256 * MIB)])
    call = channel.unary_unary(f"/{SERVICE}/{METHOD}")
    with pytest.raises(grpc.RpcError):  # a small one first: the server's threads and buffers are up before measuring
        call(b"hello", timeout=30)
    Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # peak RSS starts again from now
    before = _kib(proc.pid, "VmRSS")
    body = bytes(200 * MIB)
    codes = []

    def send() -> None:
        try:
            call(body, timeout=60)
        except grpc.RpcError as error:
            codes.append((error.code(), error.details()))

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    channel.close()
    growth_mb = (_kib(proc.pid, "VmHWM") - before) / 1024
    print(f"server peak memory growth for 4 x 200 MiB without the token: {growth_mb:.1f} MB")
    assert codes == [(grpc.StatusCode.PERMISSION_DENIED, "not a member of this job: wrong or missing token")] * 4
    assert growth_mb < 50, f"the server grew by {growth_mb:.0f} MB on requests it refused"
    assert proc.poll() is None
