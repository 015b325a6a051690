"""A worker's connection to one parameter server: token, deadlines, retries, a clear error.

Transient failures (the server is restarting, a connection dropped) are retried with
backoff until ``patience`` runs out; then the error names the server, so a worker says which
server it lost instead of hanging.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import torch

from loom.errors import LoomError
from loom.strategies.parameter_server.server import METHOD, SERVICE, TOKEN_KEY
from loom.strategies.parameter_server.transport import TLS, client_channel
from loom.strategies.parameter_server.wire import decode, encode

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


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
        self._channel = client_channel(address, tls or TLS.from_env())
        self._call = self._channel.unary_unary(f"/{SERVICE}/{METHOD}")

    def call(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return self.send(fields, tensors).result()

    def send(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> Reply:
        """Send a request without waiting for its reply, so that one thread has several out at once."""
        request = encode(fields, tensors)
        return Reply(self, fields, request, self._call.future(request, timeout=self.deadline, metadata=((TOKEN_KEY, self.token),)))

    def _retry(self, fields: dict[str, Any], request: bytes, error: grpc.RpcError) -> bytes:
        """Send ``request`` again until it is answered, with backoff, or raise a clear error."""
        give_up, wait = time.monotonic() + self.patience, 0.05
        while True:
            code = error.code()
            if code not in RETRYABLE:
                raise LoomError(f"parameter server {self.address} refused {fields.get('op')}: {error.details()}") from error
            if "handshake failed" in (error.details() or "").lower():  # retrying cannot help
                raise LoomError(
                    f"parameter server {self.address}: the TLS handshake failed; workers and servers need the same "
                    "certificate (--ps-tls-cert or LOOM_PS_TLS_CERT), naming the server's host, and servers its key"
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
        self._channel.close()


class Reply:
    """A request on its way; ``result()`` waits for the reply (retrying as ``call`` does)."""

    def __init__(self, client: ServerClient, fields: dict[str, Any], request: bytes, future: grpc.Future) -> None:
        self.client, self.fields, self.request, self.future = client, fields, request, future

    def result(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        try:
            reply = self.future.result()
        except grpc.RpcError as error:
            reply = self.client._retry(self.fields, self.request, error)
        self.client.bytes_sent += len(self.request)
        self.client.bytes_received += len(reply)
        return decode(reply)
