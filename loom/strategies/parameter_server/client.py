"""A worker's connection to one parameter server: token, deadlines, retries, a clear error.

Transient failures (the server is restarting, a connection dropped) are retried with
backoff until ``patience`` runs out; then the error names the server, so a worker says which
server it lost instead of hanging.

A training step's requests (pushes, commits, reads: each safe to send twice) go over one
long-lived stream to the server rather than a call each: a gRPC call from Python starts a
thread and costs about a millisecond of CPU on each side, several times a message on an open
stream (bench/parameter_server.py). A stream lives at most ``deadline`` seconds, so a server
that hangs is noticed as a call's deadline notices it; a stream that breaks is reopened, and
its request sent again as a call.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterator

import grpc
import torch

from loom.errors import LoomError
from loom.strategies.parameter_server.job_failure import PREFIX, JobFailedError
from loom.strategies.parameter_server.service import METHOD, SERVICE, STREAM, TOKEN_KEY
from loom.strategies.parameter_server.transport import MAX_REQUEST_ENV, TLS, client_channel, message_limit
from loom.strategies.parameter_server.wire import decode, encode

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
STREAMED = frozenset({"push", "commit", "pull", "pull_rows"})  # answered at once, and idempotent (sent again on a new stream)


class ServerUnavailableError(LoomError):
    """A parameter server did not answer within the worker's patience."""


class ServerClient:
    def __init__(self, address: str, token: str, deadline: float = 30.0, patience: float = 60.0, tls: TLS | None = None) -> None:
        """``tls``: the certificate to trust; by default from ``LOOM_PS_TLS_CERT``, else none (clear text)."""
        self.address = address
        self.token = token
        self.deadline = deadline
        self.patience = patience
        self.bytes_sent = 0  # message bytes, as handed to the transport
        self.bytes_received = 0
        self.limit = message_limit()  # the servers refuse a longer request unread: said here instead, in one line
        self._channel = client_channel(address, tls or TLS.from_env())
        self._call = self._channel.unary_unary(f"/{SERVICE}/{METHOD}")
        self._open = self._channel.stream_stream(f"/{SERVICE}/{STREAM}")
        self._stream: _Stream | None = None
        self._streaming = threading.Lock()  # held from a streamed request until its reply is read

    def call(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return self.send(fields, tensors).result()

    def send(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> Reply:
        """Send a request without waiting for its reply, so that one thread has several out at once
        (to different servers; a second request to this one while the first is out goes as a call)."""
        request = encode(fields, tensors)
        if len(request) > self.limit:
            raise LoomError(
                f"a {fields.get('op')} request of {len(request) / (1 << 20):.1f} MiB to parameter server {self.address} is over the "
                f"job's bound of {self.limit / (1 << 20):g} MiB per request; raise {MAX_REQUEST_ENV} on every task, or add servers"
            )
        if fields.get("op") in STREAMED and self._streaming.acquire(blocking=False):
            stream = self._current_stream()
            stream.requests.put(request)
            return Reply(self, fields, request, stream=stream)
        return Reply(self, fields, request, self._call.future(request, timeout=self.deadline, metadata=((TOKEN_KEY, self.token),)))

    def _current_stream(self) -> _Stream:
        """The open stream, or a new one when there is none or it is half its life old."""
        if self._stream is None or time.monotonic() > self._stream.renew_at:
            self._drop_stream()
            requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
            replies = self._open(iter(requests.get, None), timeout=self.deadline, metadata=((TOKEN_KEY, self.token),))
            self._stream = _Stream(requests, replies, time.monotonic() + self.deadline / 2)
        return self._stream

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.requests.put(None)  # the server's end of it finishes
            self._stream.replies.cancel()
            self._stream = None

    def _resend(self, fields: dict[str, Any], request: bytes) -> bytes:
        """A streamed request whose stream broke, sent again as a call."""
        try:
            return self._call(request, timeout=self.deadline, metadata=((TOKEN_KEY, self.token),))
        except grpc.RpcError as error:
            return self._retry(fields, request, error)

    def _retry(self, fields: dict[str, Any], request: bytes, error: grpc.RpcError) -> bytes:
        """Send ``request`` again until it is answered, with backoff, or raise a clear error."""
        give_up, wait = time.monotonic() + self.patience, 0.05
        while True:
            code = error.code()
            if code == grpc.StatusCode.FAILED_PRECONDITION and (error.details() or "").startswith(PREFIX):
                raise JobFailedError(f"{error.details()}; this worker stops") from None
            if code not in RETRYABLE:
                raise LoomError(f"parameter server {self.address} refused {fields.get('op')}: {error.details()}") from error
            if "handshake failed" in (error.details() or "").lower():  # retrying cannot help
                raise LoomError(
                    f"parameter server {self.address}: the TLS handshake failed; workers and servers need the same "
                    "certificate (--ps-tls-cert or LOOM_PS_TLS_CERT), or certificates from the same authority "
                    "(loom run makes them from LOOM_PS_TOKEN; else LOOM_PS_TLS_CA), a server's naming its host"
                ) from error
            if time.monotonic() + wait > give_up:
                raise ServerUnavailableError(
                    f"parameter server {self.address} did not answer for {self.patience:g}s ({code.name}); "
                    "it died or is unreachable: restart it from its checkpoint, or check the network"
                ) from error
            time.sleep(wait)
            wait = min(wait * 2, 2.0)
            try:
                return self._call(request, timeout=self.deadline, metadata=((TOKEN_KEY, self.token),))
            except grpc.RpcError as again:
                error = again

    def close(self) -> None:
        self._drop_stream()
        self._channel.close()


class _Stream:
    def __init__(self, requests: queue.SimpleQueue, replies: Any, renew_at: float) -> None:
        self.requests, self.replies, self.renew_at = requests, replies, renew_at


class Reply:
    """A request on its way; ``result()`` waits for the reply (retrying as ``call`` does)."""

    def __init__(self, client: ServerClient, fields: dict[str, Any], request: bytes, future: grpc.Future | None = None,
                 stream: _Stream | None = None) -> None:  # fmt: skip
        self.client, self.fields, self.request, self.future, self.stream = client, fields, request, future, stream

    def result(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        if self.stream is not None:
            reply = self._streamed(self.stream)
        else:
            try:
                reply = self.future.result()
            except grpc.RpcError as error:
                reply = self.client._retry(self.fields, self.request, error)
        self.client.bytes_sent += len(self.request)
        self.client.bytes_received += len(reply)
        return decode(reply)

    def _streamed(self, stream: _Stream) -> bytes:
        """The stream's next reply (the server answers a stream's requests in order); if the
        stream broke or ended, the request again as a call, and a new stream next time."""
        try:
            replies: Iterator[bytes] = stream.replies
            return next(replies)
        except (grpc.RpcError, StopIteration):
            if self.client._stream is stream:
                self.client._drop_stream()
            return self.client._resend(self.fields, self.request)
        finally:
            self.stream = None
            self.client._streaming.release()
