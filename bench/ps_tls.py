"""What TLS costs parameter-server traffic: one worker's pushes and pulls, with mutual TLS and without.

    python bench/ps_tls.py [--seconds 3] [--repeats 3]

One server process (``serve.py``) on loopback, one client here; each step pushes and commits
the gradient of a dense variable, pulls it back with the commit, and pulls a batch of table
rows, as a worker's step does. Sizes: a 4 MiB dense layer and 4,096 rows of 32 floats. With
TLS, server and client hold certificates from a job authority, as ``loom run`` makes them
across machines. Runs alternate clear and TLS ``--repeats`` times; medians of message MB/s
(sent plus received, as the client counts them) and their
ratio are printed and saved (``bench/results/ps_tls.json``), with the CPU time client and
server spent per MiB moved: on a machine that other work shares, wall-clock throughput swings
with the load, while CPU per MiB says what TLS itself costs.
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


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(tls_env: dict[str, str], seconds: float) -> tuple[float, float]:
    """Message MB/s (sent plus received) of one worker against a fresh server, and the CPU
    milliseconds (client and server) per MiB moved; clear text when ``tls_env`` is empty."""
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
        cpu = time.process_time() + _cpu_seconds(server.pid)
        while time.perf_counter() - started < seconds:
            ids = torch.randint(0, TABLE, (ROWS,), generator=generator).unique()
            client.call({"op": "push", "worker": "bench", "seq": seq, "parts": [0]}, {"grad/w": grad})
            client.call({"op": "commit", "worker": "bench", "seq": seq, "names": ["w"]})
            client.call({"op": "pull_rows", "table": "emb"}, {"ids": ids})
            seq += 1
        mib = (client.bytes_sent + client.bytes_received - moved) / 2**20
        rate, cpu = mib / (time.perf_counter() - started), time.process_time() + _cpu_seconds(server.pid) - cpu
        client.close()
        return rate, 1000 * cpu / mib
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
        cpu: dict[str, list[float]] = {"clear": [], "tls": []}
        for _ in range(args.repeats):
            for name, env in (("clear", {}), ("tls", tls_env)):
                rate, per_mib = throughput(env, args.seconds)
                runs[name].append(rate)
                cpu[name].append(per_mib)
    clear, secure = statistics.median(runs["clear"]), statistics.median(runs["tls"])
    cpu_clear, cpu_tls = statistics.median(cpu["clear"]), statistics.median(cpu["tls"])
    print(f"clear: {clear:.0f} MB/s, mutual TLS: {secure:.0f} MB/s; TLS/clear throughput ratio {secure / clear:.3f}")
    print(f"CPU per MiB moved (client + server): clear {cpu_clear:.2f} ms, TLS {cpu_tls:.2f} ms; ratio {cpu_tls / cpu_clear:.3f}")
    result = {"clear_mb_per_sec": clear, "tls_mb_per_sec": secure, "ratio": secure / clear, "runs": runs,
              "cpu_ms_per_mib": {"clear": cpu_clear, "tls": cpu_tls, "ratio": cpu_tls / cpu_clear, "runs": cpu}}  # fmt: skip
    print(f"saved {save('ps_tls', result)}")


if __name__ == "__main__":
    main()
