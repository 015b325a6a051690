"""``loom run --ps N --workers M``: parameter servers and independent workers on this machine.

The workers are not one torchrun group: in asynchronous training a worker that dies must not
stop the others. Each is a process of its own, restarted on failure up to ``--max-restarts``
times; a restarted worker pulls the current parameters and goes on. Worker 0 is the chief.
The servers listen on loopback, every request carries a token made for this job, and each
server saves its state every few seconds, so one that dies is restarted where it was.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loom.devices import available_cores
from loom.errors import LaunchError


SERVER_SAVE_SECONDS = 2.0


def _die_with_parent() -> None:
    """In the child: SIGTERM it if the launcher dies, even by SIGKILL (Linux), so no server lingers."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_parameter_server_job(
    entry: list[str],
    servers: int,
    workers: int,
    max_restarts: int = 0,
    staleness: int | None = None,
    checkpoint_dir: str | None = None,
) -> int:
    """Run ``entry`` (a script and its arguments) on ``workers`` workers against ``servers`` servers.

    Each server saves its state every few seconds under ``checkpoint_dir`` (a temporary
    directory by default); one that dies is restarted from it, up to ``max_restarts`` times.
    """
    if servers < 1 or workers < 1:
        raise LaunchError(f"a parameter-server job needs at least one server and one worker (got --ps {servers} --workers {workers})")
    threads = str(max(1, available_cores() // workers))
    env = {**os.environ, "LOOM_PS_TOKEN": secrets.token_hex(16), "OMP_NUM_THREADS": threads, "LOOM_THREADS": threads}
    ports = [_free_port() for _ in range(servers)]
    state_dir = Path(checkpoint_dir or tempfile.mkdtemp(prefix="loom-ps-"))
    state_dir.mkdir(parents=True, exist_ok=True)

    def serve(i: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "loom.strategies.parameter_server.serve", "--port", str(ports[i]), "--index", str(i),
                   "--checkpoint", str(state_dir / f"server-{i}.safetensors"), "--checkpoint-every", str(SERVER_SAVE_SECONDS)]  # fmt: skip
        return subprocess.Popen(command, env=env, preexec_fn=_die_with_parent)

    server_procs = [serve(i) for i in range(servers)]
    server_restarts = [0] * servers
    env["LOOM_PS_SERVERS"] = ",".join(f"127.0.0.1:{p}" for p in ports)
    env["LOOM_PS_WORKERS"] = str(workers)
    if staleness is not None:
        env["LOOM_PS_STALENESS"] = str(staleness)

    def start(worker: int) -> subprocess.Popen:
        command = [sys.executable, "-m", "loom.launch.worker", *entry]
        return subprocess.Popen(command, env={**env, "LOOM_PS_WORKER": str(worker)}, preexec_fn=_die_with_parent)

    running = {w: start(w) for w in range(workers)}
    restarts = dict.fromkeys(running, 0)
    failed: dict[int, int] = {}
    try:
        while running:
            time.sleep(0.2)
            for i, proc in enumerate(server_procs):
                if proc.poll() is None:
                    continue
                where = f"parameter server {i} (127.0.0.1:{ports[i]}, pid {proc.pid}) exited with code {proc.returncode}"
                if server_restarts[i] >= max_restarts:
                    print(f"loom: job failed: {where}", file=sys.stderr, flush=True)
                    return 1
                server_restarts[i] += 1
                print(f"loom: {where}; restarting it from its checkpoint ({server_restarts[i]} of {max_restarts}); the workers wait for it", file=sys.stderr, flush=True)  # fmt: skip
                server_procs[i] = serve(i)
            for worker, proc in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[worker]
                if code == 0:
                    continue
                if restarts[worker] < max_restarts:
                    restarts[worker] += 1
                    print(f"loom: worker {worker} (pid {proc.pid}) exited with code {code}; restarting it ({restarts[worker]} of {max_restarts}), the others go on", file=sys.stderr, flush=True)  # fmt: skip
                    running[worker] = start(worker)
                else:
                    failed[worker] = code
    finally:
        for proc in [*running.values(), *server_procs]:
            if proc.poll() is None:
                proc.terminate()  # servers save their state on SIGTERM
        for proc in [*running.values(), *server_procs]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    if failed:
        listed = ", ".join(f"worker {w} (code {c})" for w, c in sorted(failed.items()))
        print(f"loom: job finished with failures: {listed}; the other workers completed", file=sys.stderr, flush=True)
        return 1
    return 0
