"""What TLS costs parameter-server traffic: one worker's pushes and pulls, with mutual TLS and without.

    python bench/ps_tls.py [--seconds 3] [--repeats 3]

One server process (``serve.py``) on loopback, one client here; each step pushes and commits
the gradient of a dense variable, pulls it back with the commit, and pulls a batch of table
rows, as a worker's step does. Sizes: a 4 MiB dense layer and 4,096 rows of 32 floats. With
TLS, server and client hold certificates from a job authority, as ``loom run`` makes them
across machines. Runs alternate clear and TLS ``--repeats`` times; medians of message MB/s
(sent plus received, as the client counts them) and their
ratio are printed and saved (``bench/results/ps_tls.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.workloads import save  # noqa: E402
from loom.launch.certificates import task_certificate  # noqa: E402
from loom.strategies.parameter_server.client import ServerClient  # noqa: E402
from loom.strategies.parameter_server.transport import TLS  # noqa: E402
from tests.helpers import free_port  # noqa: E402

DENSE, ROWS, DIM, TABLE = 1 << 20, 4096, 32, 100_000
TOKEN = "bench-token"


def throughput(tls_env: dict[str, str], seconds: float) -> float:
    """Message MB/s (sent plus received) of one worker against a fresh server, clear text when ``tls_env`` is empty."""
    port = free_port()
    command = [sys.executable, "-m", "loom.strategies.parameter_server.serve", "--port", str(port)]
    server = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(ROOT), "LOOM_PS_TOKEN": TOKEN, **tls_env}, stdout=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()  # listening
        client = ServerClient(f"127.0.0.1:{port}", TOKEN, tls=TLS.from_env(env=tls_env) if tls_env else None)
        client.call({"op": "create", "optimizer": {"kind": "SGD", "groups": [{"lr": 0.01}]},
                     "generate": {"emb": {"rows": TABLE, "dim": DIM, "seed": 0}}}, {"dense/w": torch.zeros(DENSE)})  # fmt: skip
        generator = torch.Generator().manual_seed(0)
        grad = torch.randn(DENSE, generator=generator)
        started, seq, moved = time.perf_counter(), 0, client.bytes_sent + client.bytes_received
        while time.perf_counter() - started < seconds:
            ids = torch.randint(0, TABLE, (ROWS,), generator=generator).unique()
            client.call({"op": "push", "worker": "bench", "seq": seq, "parts": [0]}, {"grad/w": grad})
            client.call({"op": "commit", "worker": "bench", "seq": seq, "names": ["w"]})
            client.call({"op": "pull_rows", "table": "emb"}, {"ids": ids})
            seq += 1
        rate = (client.bytes_sent + client.bytes_received - moved) / 2**20 / (time.perf_counter() - started)
        client.close()
        return rate
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds of each run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tls_env = task_certificate(TOKEN, "127.0.0.1", Path(tmp))
        runs: dict[str, list[float]] = {"clear": [], "tls": []}
        for _ in range(args.repeats):
            runs["clear"].append(throughput({}, args.seconds))
            runs["tls"].append(throughput(tls_env, args.seconds))
    clear, secure = statistics.median(runs["clear"]), statistics.median(runs["tls"])
    print(f"clear: {clear:.0f} MB/s, mutual TLS: {secure:.0f} MB/s; TLS/clear throughput ratio {secure / clear:.3f}")
    print(f"saved {save('ps_tls', {'clear_mb_per_sec': clear, 'tls_mb_per_sec': secure, 'ratio': secure / clear, 'runs': runs})}")


if __name__ == "__main__":
    main()
