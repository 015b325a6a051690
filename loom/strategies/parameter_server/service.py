"""The gRPC face of a parameter server: who may call, and how a request becomes a reply.

One generic method carries ``wire`` messages, as a call per request or a stream of them
(``client.py``). Every call must carry the job's token in its metadata; anything else is
refused before it is read.
"""

from __future__ import annotations

from concurrent import futures
from typing import Any, Callable, Iterator

import grpc
import torch

from loom.strategies.parameter_server.state_file import LostUpdatesError
from loom.strategies.parameter_server.transport import TLS, channel_options, listen, pool_size
from loom.strategies.parameter_server.wire import WireError, decode, encode

SERVICE, METHOD, STREAM = "loom.ParameterServer", "Call", "Stream"  # a call per request, or a stream of them (client.py)
TOKEN_KEY = "loom-token"
CHANNEL_OPTIONS = channel_options()  # at the default limit (bench/ps_transport.py)

Handler = Callable[[dict[str, Any], dict[str, torch.Tensor]], tuple[dict[str, Any], dict[str, torch.Tensor]]]


class Service:
    """Serves ``handle`` to the callers that hold ``token``."""

    def __init__(self, token: str, handle: Handler) -> None:
        self.token = token
        self.handle = handle
        self._server: grpc.Server | None = None

    def _call(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._admit(context)
        return self._answer(request, context)

    def _stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """A worker's stream of requests, answered in order; a bad one ends the stream with its error."""
        self._admit(context)
        for request in requests:
            yield self._answer(request, context)

    def _admit(self, context: grpc.ServicerContext) -> None:
        if dict(context.invocation_metadata()).get(TOKEN_KEY) != self.token:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not a member of this job: wrong or missing token")

    def _answer(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            fields, tensors = decode(request)
            reply_fields, reply_tensors = self.handle(fields, tensors)
        except LostUpdatesError as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except (WireError, KeyError, IndexError) as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {error}")
        return encode(reply_fields, reply_tensors)

    def start(self, port: int, host: str = "127.0.0.1", workers: int | None = None, tls: TLS | None = None) -> int:
        """Start serving on ``host:port``; returns the bound port.

        Each worker's stream holds a thread, and so does a worker waiting for a synchronous round
        or a collective, so the pool has two per worker (``workers``) and some to spare.
        ``tls``: accept TLS only.
        """
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=pool_size(workers)), options=channel_options())
        methods = {METHOD: grpc.unary_unary_rpc_method_handler(self._call), STREAM: grpc.stream_stream_rpc_method_handler(self._stream)}
        handler = grpc.method_handlers_generic_handler(SERVICE, methods)
        self._server.add_generic_rpc_handlers((handler,))
        bound = listen(self._server, f"{host}:{port}", tls)
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port} (in use?)")
        self._server.start()
        return bound

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1).wait()
