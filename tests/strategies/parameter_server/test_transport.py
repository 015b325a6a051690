"""TLS between workers and servers, a worker's stream of requests, and a server's thread pool sized by its workers."""

import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from loom.errors import LaunchError, LoomError
from loom.launch.certificates import task_certificate
from loom.strategies.parameter_server.client import ServerClient
from loom.strategies.parameter_server.server import ParameterServer
from loom.strategies.parameter_server.service import Service
from loom.strategies.parameter_server.strategy import ParameterServerStrategy
from loom.strategies.parameter_server.transport import CERT_ENV, KEY_ENV, TLS
from tests.helpers import ROOT, free_port, job_env
from tests.scripts.clicks import Clicks


def self_signed(directory, name):
    """A certificate for 127.0.0.1 and its key, made with openssl."""
    cert, key = directory / f"{name}.pem", directory / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def tls_server(tmp_path):
    cert, key = self_signed(tmp_path, "job")
    server = ParameterServer("job-token")
    address = f"127.0.0.1:{server.serve(free_port(), tls=TLS(cert.read_bytes(), key.read_bytes()))}"
    yield address, cert
    server.stop()


def test_a_job_with_tls_trains_and_a_client_without_the_certificate_is_refused(tls_server, tmp_path, monkeypatch):
    address, cert = tls_server
    monkeypatch.setenv(CERT_ENV, str(cert))
    strategy = ParameterServerStrategy([address], token="job-token", worker=0, num_workers=1)
    model, opt = strategy.prepare(Clicks(), lambda p: torch.optim.SGD(p, lr=0.5))
    ids = torch.randint(0, 50, (16, 5), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(5):
        loss = F.binary_cross_entropy_with_logits(model(ids), (ids % 7 == 0).any(1).float())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    strategy.shutdown()
    monkeypatch.delenv(CERT_ENV)
    stranger, _ = self_signed(tmp_path, "stranger")
    refusals = {
        None: f"parameter server {address} did not answer",  # clear text
        TLS(stranger.read_bytes()): f"parameter server {address}: the TLS handshake failed; workers and servers need the same",
    }
    for tls, refusal in refusals.items():
        client = ServerClient(address, "job-token", patience=1, tls=tls)
        with pytest.raises(LoomError, match=refusal):
            client.call({"op": "ready"})
        client.close()


def test_a_half_set_tls_configuration_is_one_clear_line(tmp_path):
    with pytest.raises(LaunchError, match=f"{KEY_ENV} is set but {CERT_ENV} is not: set both"):
        TLS.from_env(env={KEY_ENV: "k.pem"})
    (tmp_path / "c.pem").write_text("x")
    with pytest.raises(LaunchError, match=f"{CERT_ENV} is set but {KEY_ENV} is not: a parameter server needs"):
        TLS.from_env(server=True, env={CERT_ENV: str(tmp_path / "c.pem")})
    with pytest.raises(LaunchError, match=f"{CERT_ENV}=nowhere.pem: cannot read it"):
        TLS.from_env(env={CERT_ENV: "nowhere.pem"})


def test_workers_waiting_for_a_round_do_not_queue_the_others_calls():
    """64 synchronous workers each hold a thread while they wait; a 65th worker's pull is not queued behind them."""
    workers = 64
    server = ParameterServer("job-token", {"w": torch.zeros(2)})
    address = f"127.0.0.1:{server.serve(free_port(), workers=workers + 1)}"
    clients = [ServerClient(address, "job-token") for _ in range(workers + 1)]
    waiting = [threading.Thread(target=c.call, args=({"op": "round", "round": 0, "wait": 1.0},)) for c in clients[:workers]]
    for t in waiting:
        t.start()
    time.sleep(0.3)  # every waiter is in its round wait
    start = time.monotonic()
    clients[-1].call({"op": "pull", "names": ["w"]})
    took = time.monotonic() - start
    for t in waiting:
        t.join(timeout=10)
    for c in clients:
        c.close()
    server.stop()
    assert took < 0.3, f"the pull waited {took:.2f}s for a free thread"


def test_a_workers_step_requests_share_one_stream_that_survives_a_restart_and_is_renewed(monkeypatch):
    """Pushes, commits and reads ride one stream per server (not a call each); a stream broken by
    a server restart is reopened (its request sent again), and one half its deadline old is renewed."""
    port, opened, serving_now = free_port(), [], []
    answer = Service._stream
    monkeypatch.setattr(Service, "_stream", lambda self, requests, context: (opened.append(serving_now[-1]), (yield from answer(self, requests, context)))[1])

    def serving(value):
        server = ParameterServer("job-token", {"w": torch.full((2,), value)})
        serving_now.append(value)
        server.serve(port)
        return server

    first = serving(1.0)
    client = ServerClient(f"127.0.0.1:{port}", "job-token", deadline=1.0, patience=10)
    for _ in range(3):
        assert torch.equal(client.call({"op": "pull", "names": ["w"]})[1]["w"], torch.ones(2))
    client.call({"op": "stats"})  # not a step's request: a call of its own
    assert opened == [1.0]
    first.stop()
    second = serving(2.0)
    assert torch.equal(client.call({"op": "pull", "names": ["w"]})[1]["w"], torch.full((2,), 2.0))
    client.call({"op": "pull", "names": ["w"]})
    assert opened == [1.0, 2.0]
    time.sleep(0.6)  # past half the stream's deadline
    client.call({"op": "pull", "names": ["w"]})
    assert opened == [1.0, 2.0, 2.0]
    client.close()
    second.stop()


def test_a_port_in_use_by_a_parameter_server_is_one_line(tmp_path):
    """A second server on a first one's port is refused (gRPC alone would share the port between
    them), in one line: in-process as an error, and as a process its only output."""
    first = ParameterServer("job-token")
    port = first.serve(free_port())
    try:
        with pytest.raises(LaunchError, match=rf"^cannot listen on 127.0.0.1:{port}: the port is in use; stop what holds it"):
            ParameterServer("job-token").serve(port)
        command = [sys.executable, "-m", "loom.strategies.parameter_server.serve", "--port", str(port), "--index", "1"]
        done = subprocess.run(command, env=job_env({"LOOM_PS_TOKEN": "job-token"}), cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        first.stop()
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        f"loom: error: parameter server 1: cannot listen on 127.0.0.1:{port}: the port is in use; "
        "stop what holds it (another parameter server?) or give this server another port\n"
    )


def test_mutual_tls_from_the_job_authority_admits_the_jobs_tasks_only(tmp_path):
    """Certificates made by two launchers of one job (each from the token alone) meet; a client
    with no certificate, or one from another job's authority, is refused at the handshake."""
    server_tls, worker_tls, stranger_tls = (
        TLS.from_env(env=task_certificate(token, "127.0.0.1", tmp_path / name))
        for name, token in (("server", "job-token"), ("worker", "job-token"), ("stranger", "another-job"))
    )
    server = ParameterServer("job-token", {"w": torch.ones(2)})
    address = f"127.0.0.1:{server.serve(free_port(), tls=server_tls)}"
    try:
        client = ServerClient(address, "job-token", patience=2, tls=worker_tls)
        assert torch.equal(client.call({"op": "pull", "names": ["w"]})[1]["w"], torch.ones(2))
        client.close()
        for tls in (TLS(server_tls.authority), stranger_tls):  # trusts the server, but shows no certificate; another job's
            client = ServerClient(address, "job-token", patience=1, tls=tls)
            with pytest.raises(LoomError, match=f"parameter server {address}"):
                client.call({"op": "ready"})
            client.close()
    finally:
        server.stop()
    assert (tmp_path / "server" / "task.key").stat().st_mode & 0o077 == 0
