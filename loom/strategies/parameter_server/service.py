"""The gRPC face of a parameter server: who may call, and how a request becomes a reply.

One generic method carries ``wire`` messages, as a call per request or a stream of them
(``client.py``). Every call must carry the job's token in its metadata: ``TokenCheck`` reads it
from the call's metadata, before any of the call's body, and refuses a call without it; the
body of a refused call is never received, so traffic from outside the job costs no memory.
"""

from __future__ import annotations

import hmac
from concurrent import futures
from typing import Any, Callable, Iterator

import grpc
import torch

from loom.strategies.parameter_server.job_failure import JobFailedError
from loom.strategies.parameter_server.state_file import LostUpdatesError
from loom.strategies.parameter_server.transport import TLS, listen, pool_size, server_options
from loom.strategies.parameter_server.wire import WireError, decode, encode

SERVICE, METHOD, STREAM = "loom.ParameterServer", "Call", "Stream"  # a call per request, or a stream of them (client.py)
TOKEN_KEY = "loom-token"

Handler = Callable[[dict[str, Any], dict[str, torch.Tensor]], tuple[dict[str, Any], dict[str, torch.Tensor]]]


class TokenCheck(grpc.ServerInterceptor):
    """Admits a call only with the job's token in its metadata, checked before its body is read."""

    def __init__(self, token: str) -> None:
        self.token = token.encode()
        self.refuse = grpc.stream_stream_rpc_method_handler(_refuse)  # takes the requests as a stream: reads none of them

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        offered = dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if isinstance(offered, str) and hmac.compare_digest(offered.encode(), self.token):
            return continuation(details)
        return self.refuse


def _refuse(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    context.abort(grpc.StatusCode.PERMISSION_DENIED, "not a member of this job: wrong or missing token")
    yield b""  # never reached: a generator, as a stream's handler is


class Service:
    """Serves ``handle`` to the callers that hold ``token``."""

    def __init__(self, token: str, handle: Handler) -> None:
        self.token = token
        self.handle = handle
        self._server: grpc.Server | None = None

    def _stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """A worker's stream of requests, answered in order; a bad one ends the stream with its error."""
        for request in requests:
            yield self._answer(request, context)

    def _answer(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            fields, tensors = decode(request)
            reply_fields, reply_tensors = self.handle(fields, tensors)
        except (LostUpdatesError, JobFailedError) as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except (WireError, KeyError, IndexError) as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {_line(error)}")
        except (TypeError, ValueError, RuntimeError, OverflowError) as error:  # what checking the request could not foresee (torch's own checks)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad request: {type(error).__name__}: {_line(error)}")
        return encode(reply_fields, reply_tensors)

    def start(self, port: int, host: str = "127.0.0.1", workers: int | None = None, tls: TLS | None = None) -> int:
        """Start serving on ``host:port``; returns the bound port.

        Each worker's stream holds a thread, and so does a worker waiting for a synchronous round
        or a collective, so the pool has two per worker (``workers``) and some to spare.
        ``tls``: accept TLS only.
        """
        pool = futures.ThreadPoolExecutor(max_workers=pool_size(workers))
        self._server = grpc.server(pool, interceptors=[TokenCheck(self.token)], options=server_options())
        methods = {METHOD: grpc.unary_unary_rpc_method_handler(self._answer), STREAM: grpc.stream_stream_rpc_method_handler(self._stream)}
        handler = grpc.method_handlers_generic_handler(SERVICE, methods)
        self._server.add_generic_rpc_handlers((handler,))
        bound = listen(self._server, host, port, tls)
        self._server.start()
        return bound

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=1).wait()


def _line(error: Exception) -> str:
    """An error's first line, for a status that is one line."""
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__
