"""A parameter server against outsiders (refused before their requests are read) and malformed requests (refused in one line)."""

import contextlib
import json
import random
import struct
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch

from loom.errors import LaunchError, LoomError
from loom.strategies.parameter_server.client import ServerClient
from loom.strategies.parameter_server.optimizers import ServerOptimizer
from loom.strategies.parameter_server.server import ParameterServer
from loom.strategies.parameter_server.service import METHOD, SERVICE, TOKEN_KEY
from loom.strategies.parameter_server.transport import message_limit
from loom.strategies.parameter_server.wire import decode, encode
from tests.helpers import ROOT, free_port, job_env

MIB = 1 << 20


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@contextlib.contextmanager
def served(env=None):
    """A parameter server in its own process (``serve.py``), so its memory is its own."""
    port = free_port()
    command = [sys.executable, "-m", "loom.strategies.parameter_server.serve", "--port", str(port)]
    proc = subprocess.Popen(command, env=job_env({"LOOM_PS_TOKEN": "the-job", **(env or {})}), cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in proc.stdout.readline()
        yield proc, f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def server_process():
    with served() as started:
        yield started


def _peak_growth_mb(proc, send, count=4):
    """How far the server's peak memory rose while ``count`` threads each ran ``send()``."""
    Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # peak RSS starts again from now
    before = _kib(proc.pid, "VmRSS")
    threads = [threading.Thread(target=send) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    return (_kib(proc.pid, "VmHWM") - before) / 1024


def test_large_requests_without_the_token_are_refused_unread(server_process):
    """Four concurrent 200 MiB requests without the token: each refused, and the server's peak
    memory grows by far less than one of them (it grew by all four when the token was checked
    after the body had been received)."""
    proc, address = server_process
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 256 * MIB)])
    call = channel.unary_unary(f"/{SERVICE}/{METHOD}")
    with pytest.raises(grpc.RpcError):  # a small one first: the server's threads and buffers are up before measuring
        call(b"hello", timeout=30)
    body = bytes(200 * MIB)
    codes = []

    def send() -> None:
        try:
            call(body, timeout=60)
        except grpc.RpcError as error:
            codes.append((error.code(), error.details()))

    growth_mb = _peak_growth_mb(proc, send)
    channel.close()
    print(f"server peak memory growth for 4 x 200 MiB without the token: {growth_mb:.1f} MB")
    assert codes == [(grpc.StatusCode.PERMISSION_DENIED, "not a member of this job: wrong or missing token")] * 4
    assert growth_mb < 50, f"the server grew by {growth_mb:.0f} MB on requests it refused"
    assert proc.poll() is None


def test_requests_over_the_jobs_bound_are_refused_before_they_are_buffered_even_with_the_token(monkeypatch):
    """LOOM_PS_MAX_REQUEST_MB=16: four concurrent 100 MiB requests that carry the token are each
    refused with the reason, the server holds no more of them than the bound, and it serves on; a worker about
    to send more than the bound says so in one line, naming the setting."""
    with served({"LOOM_PS_MAX_REQUEST_MB": "16"}) as (proc, address):
        channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 256 * MIB)])
        call = channel.unary_unary(f"/{SERVICE}/{METHOD}")
        assert decode(call(encode({"op": "ready"}), timeout=30, metadata=((TOKEN_KEY, "the-job"),)))[0] == {"ready": False}
        body, codes = encode({"op": "pull", "names": []}, {"ids/emb": torch.zeros(100 * MIB // 8, dtype=torch.int64)}), []

        def send() -> None:
            try:
                call(body, timeout=60, metadata=((TOKEN_KEY, "the-job"),))
            except grpc.RpcError as error:
                codes.append((error.code(), error.details()))

        growth_mb = _peak_growth_mb(proc, send)
        print(f"server peak memory growth for 4 x 100 MiB with the token over a 16 MiB bound: {growth_mb:.1f} MB")
        assert [code for code, _ in codes] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4, codes
        assert all(f"larger than max ({len(body)} vs. {16 * MIB})" in details for _, details in codes), codes
        # gRPC's transport holds part of each request before it refuses it (61 MB seen for the four on a loaded
        # machine): at most about the bound each, against the 400 MiB a server buffering them whole would hold
        assert growth_mb < 4 * 16 + 16, f"the server grew by {growth_mb:.0f} MB on requests over its bound"
        assert decode(call(encode({"op": "ready"}), timeout=30, metadata=((TOKEN_KEY, "the-job"),)))[0] == {"ready": False}
        channel.close()
        monkeypatch.setenv("LOOM_PS_MAX_REQUEST_MB", "16")  # as every task of the job has it
        client = ServerClient(address, "the-job")
        with pytest.raises(LoomError, match=r"^a push request of 20\.0 MiB to parameter server .* is over the job's bound of 16 MiB "
                                            r"per request; raise LOOM_PS_MAX_REQUEST_MB on every task, or add servers$"):  # fmt: skip
            client.call({"op": "push", "worker": "w", "seq": 0}, {"grad/w": torch.zeros(5 * MIB)})
        client.close()


def test_a_bound_that_is_not_a_size_is_one_line():
    for value in ("nan", "inf", "0", "-4", "0.5", "4096", "lots"):
        with pytest.raises(LaunchError, match=rf"^LOOM_PS_MAX_REQUEST_MB='{value}' is not a number of MiB from 1 to 2047; "):
            message_limit({"LOOM_PS_MAX_REQUEST_MB": value})
    assert message_limit({"LOOM_PS_MAX_REQUEST_MB": "1.5"}) == 3 * MIB // 2 and message_limit({}) == 256 * MIB
    command = [sys.executable, "-m", "loom.strategies.parameter_server.serve", "--port", str(free_port())]
    ended = subprocess.run(command, env=job_env({"LOOM_PS_TOKEN": "t", "LOOM_PS_MAX_REQUEST_MB": "nan"}), cwd=ROOT,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ended.returncode == 2 and ended.stderr.startswith("loom: error: LOOM_PS_MAX_REQUEST_MB='nan'") and ended.stderr.count("\n") == 1


# ---- malformed requests from a caller that holds the token ------------------------------------
EXAMPLES = {  # a valid request of each operation, against the ``fuzzed`` server; none changes its variables
    "create": ({"optimizer": {"kind": "SGD", "groups": [{"lr": 0.1}]}, "generate": {"t": {"rows": 2, "dim": 2, "seed": 0}}}, {}),
    "ready": ({}, {}),
    "pull": ({"names": ["w"]}, {"ids/emb": torch.tensor([0, 1])}),
    "pull_rows": ({"table": "emb"}, {"ids": torch.tensor([1])}),
    "push": ({"worker": "fuzz", "seq": 0, "index": 0, "hyper": [{"lr": 0.5}], "based_on": 0, "parts": [0]}, {"grad/w": torch.zeros(2, 3)}),
    "commit": ({"worker": "fuzz", "seq": 0, "names": ["w"]}, {}),
    "abort": ({"worker": "fuzz", "seq": 1}, {}),
    "pending": ({"worker": "fuzz"}, {}),
    "round": ({"round": -1, "wait": 0}, {}),
    "tick": ({"worker": 0, "clock": 1, "workers": 2, "lease": 5.0}, {}),
    "finish": ({"worker": 7, "code": 0}, {}),
    "meet": ({"worker": 0, "number": 0, "workers": 1, "reduce": "sum", "wait": 0}, {"value": torch.ones(2)}),
    "read": ({"name": "w", "start": 0, "budget": 1024}, {}),
    "write": ({"name": "w", "start": 0}, {"value": torch.ones(1, 3)}),
    "lineage": ({"add": "ckpt-1"}, {}),
    "stats": ({}, {}),
}
WRONG = [None, "x", 1.5, -1, [], {}, [[1]], True, 10**30, float("nan")]  # JSON of other types, and numbers out of range


def raw(header, tensor_bytes: bytes = b"") -> bytes:
    """A message as ``wire.encode`` lays it out, from any header (JSON text or a value)."""
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    return struct.pack("<I", len(text)) + text + tensor_bytes


@pytest.fixture(scope="module")
def fuzzed():
    server = ParameterServer("secret", {"w": torch.ones(2, 3)}, {"emb": torch.zeros(5, 4)}, ServerOptimizer("SGD", [{"lr": 0.5}]))
    port = server.serve(free_port())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary(f"/{SERVICE}/{METHOD}")

    def send(message: bytes) -> tuple[grpc.StatusCode, str]:
        try:
            call(message, timeout=30, metadata=((TOKEN_KEY, "secret"),))
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as error:
            return error.code(), error.details()

    yield send, f"127.0.0.1:{port}"
    channel.close()
    server.stop()


def refused(answer: tuple[grpc.StatusCode, str]) -> str:
    """The one-line reason of an INVALID_ARGUMENT answer."""
    code, details = answer
    assert code == grpc.StatusCode.INVALID_ARGUMENT, answer
    assert details.startswith("bad request: ") and "\n" not in details, details
    return details


def test_the_reproduced_malformed_requests_are_refused_with_a_reason(fuzzed):
    send, _ = fuzzed
    assert "the fields must be a JSON object, not list" in refused(send(raw({"fields": [["op", "pull"]], "tensors": []})))
    assert "a tensor entry must be [name, dtype, shape]" in refused(send(raw({"fields": {"op": "pull", "names": []}, "tensors": [["ids/emb", "int64"]]})))
    assert "nested too deeply" in refused(send(raw("[" * 100_000 + "]" * 100_000)))
    assert "pull: field 'names' is not what pull takes: 'w'" in refused(send(encode({"op": "pull", "names": "w"})))


def test_fuzzed_requests_get_invalid_argument_and_the_server_lives_on(fuzzed):
    """Seeded random bytes, truncated frames, a wrong type at every field of every operation,
    deep nesting and huge declared shapes: each answered (a few, by chance, are valid) or refused
    with one line, never an internal error; afterwards the server answers and its variables are intact."""
    send, address = fuzzed
    rng = random.Random(28)
    answers = []
    for _ in range(60):  # random bytes, some behind a plausible header length
        noise = rng.randbytes(rng.randrange(0, 200))
        answers.append(send(noise))
        answers.append(send(struct.pack("<I", rng.randrange(0, 64)) + noise))
    for op, (fields, tensors) in EXAMPLES.items():
        whole = encode({"op": op, **fields}, tensors)
        for cut in sorted(rng.sample(range(len(whole)), min(6, len(whole)))):  # truncated frames
            answers.append(send(whole[:cut]))
        for name in [*fields, "seen", "op"]:
            for wrong in WRONG:
                if name == "seen" and isinstance(wrong, int):
                    continue  # a whole number is a valid 'seen' (a larger one says this server lost updates)
                answers.append(send(encode({"op": op, **fields, name: wrong}, tensors)))
        answers.append(send(encode({"op": op, **fields, "unexpected": 1}, tensors)))
        for key in tensors:  # a tensor of the wrong kind, or under a name the operation does not take
            answers.append(send(encode({"op": op, **fields}, {**tensors, key: torch.ones(2, dtype=torch.float64)})))
            answers.append(send(encode({"op": op, **fields}, {**tensors, f"x{key}": torch.ones(1)})))
    for depth in (10, 500, 5_000, 100_000):  # deep nesting, in the header and in a field
        answers.append(send(raw("{" + '"a":{' * depth + "}" * (depth + 1))))
        answers.append(send(raw('{"fields": {"op": "pull", "names": ' + "[" * depth + "]" * depth + '}, "tensors": []}')))
    for shape in ([2**40], [2**62, 2**62], [0, 2**70], [-1], ["a"], [2] * 100, 7, [True]):  # huge or impossible declared shapes
        answers.append(send(raw({"fields": {"op": "pull", "names": []}, "tensors": [["ids/emb", "int64", shape]]})))
    for answer in answers:
        if answer[0] != grpc.StatusCode.OK:
            refused(answer)
    assert len(answers) > 300 and sum(code == grpc.StatusCode.INVALID_ARGUMENT for code, _ in answers) > 0.9 * len(answers)
    client = ServerClient(address, "secret", patience=2)
    assert torch.equal(client.call({"op": "pull", "names": ["w"]})[1]["w"], torch.ones(2, 3))
    client.close()
