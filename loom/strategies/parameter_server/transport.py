"""How workers and servers reach each other: message limit, TLS, and the threads a server serves with.

Without TLS every message, the job's token and each gradient included, crosses the network
in clear text; that is fine on loopback (a one-machine job) and on a network only the job
uses. With ``LOOM_PS_TLS_CERT`` (a PEM certificate; on a server also ``LOOM_PS_TLS_KEY``, its
private key) the servers accept only TLS, and workers trust that certificate alone: a
process without it cannot talk to them. The certificate must name every server's host
(subjectAltName), as gRPC checks it like a browser does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import grpc

from loom.errors import LaunchError

MESSAGE_LIMIT = 256 << 20  # bytes in one gRPC message, each way
CERT_ENV, KEY_ENV = "LOOM_PS_TLS_CERT", "LOOM_PS_TLS_KEY"
MIN_THREADS = 32
SPARE_THREADS = 16  # beyond one per worker: launchers settling pushes, the chief's job report


def channel_options() -> list[tuple[str, int]]:
    """Read when a channel or server is made, so a test can lower the limit."""
    return [("grpc.max_send_message_length", MESSAGE_LIMIT), ("grpc.max_receive_message_length", MESSAGE_LIMIT)]


def chunk_bytes() -> int:
    """Tensor bytes per message when a variable is streamed in pieces (saving, restoring)."""
    return MESSAGE_LIMIT // 4


def pool_size(workers: int | None) -> int:
    """Threads for a server: each worker's stream holds one (client.py), and a worker makes one
    call at a time besides, which may wait for its round, so two per worker keep any call from queueing."""
    return max(MIN_THREADS, 2 * (workers or 0) + SPARE_THREADS)


@dataclass(frozen=True)
class TLS:
    """A certificate the workers trust and the servers present, with its key on the servers."""

    certificate: bytes
    key: bytes | None = None

    @classmethod
    def from_env(cls, server: bool = False, env: Mapping[str, str] | None = None) -> TLS | None:
        """TLS from ``LOOM_PS_TLS_CERT``/``LOOM_PS_TLS_KEY`` (file paths), or None when unset."""
        env = os.environ if env is None else env
        cert, key = env.get(CERT_ENV), env.get(KEY_ENV)
        if not cert:
            if key:
                raise LaunchError(f"{KEY_ENV} is set but {CERT_ENV} is not: set both, to the certificate and its key")
            return None
        if server and not key:
            raise LaunchError(f"{CERT_ENV} is set but {KEY_ENV} is not: a parameter server needs its certificate's private key")
        return cls(_read(cert, CERT_ENV), _read(key, KEY_ENV) if server and key else None)

    def channel(self, address: str) -> grpc.Channel:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=self.certificate), options=channel_options())

    def listen(self, server: grpc.Server, address: str) -> int:
        if self.key is None:
            raise LaunchError(f"a parameter server with TLS needs the certificate's private key ({KEY_ENV})")
        return server.add_secure_port(address, grpc.ssl_server_credentials([(self.key, self.certificate)]))


def client_channel(address: str, tls: TLS | None) -> grpc.Channel:
    return tls.channel(address) if tls else grpc.insecure_channel(address, options=channel_options())


def listen(server: grpc.Server, address: str, tls: TLS | None) -> int:
    return tls.listen(server, address) if tls else server.add_insecure_port(address)


def _read(path: str, variable: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise LaunchError(f"{variable}={path}: cannot read it ({error.strerror}); point it at a PEM file") from None
