"""How workers and servers reach each other: message limit, TLS, and the threads a server serves with.

One message, each way, holds at most ``LOOM_PS_MAX_REQUEST_MB`` MiB (256 by default). gRPC
refuses a longer request from the length in its frame before buffering its body, so a process
that holds the token cannot make a server buffer more than that per call; a job whose largest
request (the chief's ``create`` of a server's share, or a push) is small can set it lower, and a
worker about to send more than the bound says so in one line instead of sending it.

Without TLS every message, the job's token and each gradient included, crosses the network
in clear text; loom runs that way only where every server is on loopback. Two set-ups:

- mutual TLS (``LOOM_PS_TLS_CA``, ``LOOM_PS_TLS_CERT``, ``LOOM_PS_TLS_KEY`` on every process):
  each side presents its own certificate and key, and accepts only a peer whose certificate
  the CA signed. ``loom run`` makes these for a job across machines (``launch/certificates.py``);
  a cluster with its own certificates sets them.
- one shared certificate (``LOOM_PS_TLS_CERT``; on a server also ``LOOM_PS_TLS_KEY``): the
  servers present it and workers trust it alone.

A server's certificate must name its host (subjectAltName), as gRPC checks it like a browser does.
"""

from __future__ import annotations

import errno
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import grpc

from loom.errors import LaunchError

MESSAGE_LIMIT = 256 << 20  # bytes in one gRPC message, each way, unless LOOM_PS_MAX_REQUEST_MB says otherwise
MAX_REQUEST_ENV = "LOOM_PS_MAX_REQUEST_MB"
GRPC_MAX_MB = 2047  # gRPC counts a message's length in a signed 32-bit integer
CA_ENV, CERT_ENV, KEY_ENV = "LOOM_PS_TLS_CA", "LOOM_PS_TLS_CERT", "LOOM_PS_TLS_KEY"
MIN_THREADS = 32
SPARE_THREADS = 16  # beyond one per worker: launchers settling pushes, the chief's job report


def message_limit(env: Mapping[str, str] | None = None) -> int:
    """Bytes one message may hold: ``LOOM_PS_MAX_REQUEST_MB`` (MiB, a finite number from 1 to 2047), else the default."""
    text = (os.environ if env is None else env).get(MAX_REQUEST_ENV)
    if text is None or text == "":
        return MESSAGE_LIMIT
    try:
        megabytes = float(text)
    except ValueError:
        megabytes = math.nan
    if not (math.isfinite(megabytes) and 1 <= megabytes <= GRPC_MAX_MB):
        raise LaunchError(
            f"{MAX_REQUEST_ENV}={text!r} is not a number of MiB from 1 to {GRPC_MAX_MB}; set it to the largest request the "
            f"job needs, or unset it for {MESSAGE_LIMIT >> 20}"
        )
    return int(megabytes * (1 << 20))


def channel_options() -> list[tuple[str, int]]:
    """Read when a channel or server is made, so a test can lower the limit."""
    limit = message_limit()
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def chunk_bytes() -> int:
    """Tensor bytes per message when a variable is streamed in pieces (saving, restoring)."""
    return message_limit() // 4


def pool_size(workers: int | None) -> int:
    """Threads for a server: each worker's stream holds one (client.py), and a worker makes one
    call at a time besides, which may wait for its round, so two per worker keep any call from queueing."""
    return max(MIN_THREADS, 2 * (workers or 0) + SPARE_THREADS)


@dataclass(frozen=True)
class TLS:
    """A certificate the workers trust and the servers present, with its key on the servers; or,
    with ``authority``, this process's own certificate and key, and the CA its peers' must come from."""

    certificate: bytes
    key: bytes | None = None
    authority: bytes | None = None

    @classmethod
    def from_env(cls, server: bool = False, env: Mapping[str, str] | None = None) -> TLS | None:
        """TLS from ``LOOM_PS_TLS_CA``/``LOOM_PS_TLS_CERT``/``LOOM_PS_TLS_KEY`` (file paths), or None when unset."""
        env = os.environ if env is None else env
        ca, cert, key = env.get(CA_ENV), env.get(CERT_ENV), env.get(KEY_ENV)
        if ca:
            if not (cert and key):
                raise LaunchError(f"{CA_ENV} is set but {CERT_ENV} or {KEY_ENV} is not: with a CA, every process needs its own certificate and key")
            return cls(_read(cert, CERT_ENV), _read(key, KEY_ENV), _read(ca, CA_ENV))
        if not cert:
            if key:
                raise LaunchError(f"{KEY_ENV} is set but {CERT_ENV} is not: set both, to the certificate and its key")
            return None
        if server and not key:
            raise LaunchError(f"{CERT_ENV} is set but {KEY_ENV} is not: a parameter server needs its certificate's private key")
        return cls(_read(cert, CERT_ENV), _read(key, KEY_ENV) if server and key else None)

    def channel(self, address: str) -> grpc.Channel:
        if self.authority is None:
            credentials = grpc.ssl_channel_credentials(root_certificates=self.certificate)
        else:
            credentials = grpc.ssl_channel_credentials(self.authority, private_key=self.key, certificate_chain=self.certificate)
        return grpc.secure_channel(address, credentials, options=channel_options())

    def listen(self, server: grpc.Server, address: str) -> int:
        if self.key is None:
            raise LaunchError(f"a parameter server with TLS needs the certificate's private key ({KEY_ENV})")
        mutual = self.authority is not None
        credentials = grpc.ssl_server_credentials([(self.key, self.certificate)], root_certificates=self.authority, require_client_auth=mutual)
        return server.add_secure_port(address, credentials)


def client_channel(address: str, tls: TLS | None) -> grpc.Channel:
    return tls.channel(address) if tls else grpc.insecure_channel(address, options=channel_options())


def server_options() -> list[tuple[str, int]]:
    """A server's options: the message limit, and a port of its own (gRPC would otherwise share
    it, with SO_REUSEPORT, with another server already on it: two servers answering by turns)."""
    return [*channel_options(), ("grpc.so_reuseport", 0)]


def listen(server: grpc.Server, host: str, port: int, tls: TLS | None) -> int:
    """Bind ``host:port``; a port in use, or an address not on this machine, is one line."""
    if port:
        check_free(host, port)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        return tls.listen(server, address) if tls else server.add_insecure_port(address)
    except RuntimeError:  # taken since the check
        raise LaunchError(f"cannot listen on {address}: the port is in use; {PORT_FIX}") from None


PORT_FIX = "stop what holds it (another parameter server?) or give this server another port"


def check_free(host: str, port: int) -> None:
    """Bind ``host:port`` as gRPC would, and let go: a clear line now instead of gRPC's traceback."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise LaunchError(f"cannot listen on {host}:{port}: {error.strerror}; give a host name or address of this machine") from None
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError as error:
                if error.errno == errno.EADDRINUSE:
                    raise LaunchError(f"cannot listen on {host}:{port}: the port is in use; {PORT_FIX}") from None
                raise LaunchError(f"cannot listen on {host}:{port}: {error.strerror}; give an address of this machine") from None


def _read(path: str, variable: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise LaunchError(f"{variable}={path}: cannot read it ({error.strerror}); point it at a PEM file") from None
