"""Which RPC engine carries parameter-server traffic: gRPC (grpcio) or torch.distributed.rpc.

    python bench/ps_transport.py

One server process, one client, on loopback. Each engine echoes a float32 tensor (the
payloads a PS worker sends: a pull of embedding rows or a push of their gradients) and the
client measures the round trip; both move raw tensor bytes, no pickle in the gRPC path.
Prints and saves median round-trip times and MB/s per payload size.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.workloads import save  # noqa: E402
from loom.strategies.parameter_server.transport import channel_options  # noqa: E402

SIZES = [4 * 1024, 128 * 1024, 4 * 1024 * 1024]  # bytes: a few rows, a batch of rows, a dense layer
ROUNDS = 200


def median_round_trips(echo: Callable[[torch.Tensor], Any]) -> dict[int, float]:
    """Median seconds of ``echo(payload)`` for each payload size."""
    results = {}
    for size in SIZES:
        payload = torch.randn(size // 4)
        times = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            echo(payload)
            times.append(time.perf_counter() - start)
        results[size] = statistics.median(times)
    return results


def _echo_bytes(request: bytes, context: object) -> bytes:
    return request


def _grpc_server(port: int, ready: multiprocessing.Event, stop: multiprocessing.Event) -> None:
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=channel_options())
    handler = grpc.method_handlers_generic_handler("bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo_bytes)})
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    stop.wait()
    server.stop(0)


def grpc_round_trips(port: int) -> dict[int, float]:
    import grpc

    ready, stop = multiprocessing.Event(), multiprocessing.Event()
    server = multiprocessing.Process(target=_grpc_server, args=(port, ready, stop))
    server.start()
    ready.wait(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
    call = channel.unary_unary("/bench.Echo/Echo")
    results = median_round_trips(
        lambda payload: torch.frombuffer(bytearray(call(payload.numpy().tobytes(), timeout=10)), dtype=torch.float32)
    )
    channel.close()
    stop.set()
    server.join()
    return results


def _echo_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _rpc_process(rank: int, port: int, results: multiprocessing.Queue) -> None:
    import torch.distributed.rpc as rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc(f"p{rank}", rank=rank, world_size=2)
    if rank == 0:
        results.put(median_round_trips(lambda payload: rpc.rpc_sync("p1", _echo_tensor, args=(payload,))))
    rpc.shutdown()


def torch_rpc_round_trips(port: int) -> dict[int, float]:
    results: multiprocessing.Queue = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_rpc_process, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = results.get(timeout=300)
    for p in procs:
        p.join()
    return out


def main() -> None:
    from tests.helpers import free_port

    engines = {"grpc": grpc_round_trips(free_port()), "torch.distributed.rpc": torch_rpc_round_trips(free_port())}
    print(f"{'payload':>10}  " + "  ".join(f"{name:>28}" for name in engines))
    for size in SIZES:
        cells = [f"{engines[n][size] * 1e6:9.0f} us {2 * size / engines[n][size] / 2**20:8.0f} MB/s" for n in engines]
        print(f"{size // 1024:>7} KB  " + "  ".join(f"{c:>28}" for c in cells))
    print(f"saved {save('ps_transport', {str(k): {str(s): t for s, t in v.items()} for k, v in engines.items()})}")


if __name__ == "__main__":
    main()
