"""Run code on N gloo ranks from a test, with a timeout, re-raising a child's traceback."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
LOOM = [sys.executable, "-m", "loom.launch.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, results: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", LOOM_THREADS="1",
    )  # fmt: skip
    try:
        # Plain pickle: a tensor sent through the queue as-is goes by shared memory, which
        # is gone once this process exits.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """``fn(*args)`` on ``world`` spawned ranks set up as torchrun would; returns results by rank.

    The parent hosts the job's store, as torchrun's agent does. A child's exception is re-raised
    here with its traceback; a rank that does not finish within ``timeout`` fails the test.
    """
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    try:
        for _ in range(world):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world)) - set(collected))
                raise TimeoutError(f"rank(s) {missing} did not finish within {timeout}s") from None
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            collected[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store
    return [collected[r] for r in range(world)]


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a job a test starts: this checkout importable, no inherited TF_CONFIG."""
    inherited = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}  # only an explicit one counts
    return {**inherited, "PYTHONPATH": str(ROOT), **(extra or {})}


def loom_run(args: list[str], timeout: float = 120.0, env: dict[str, str] | None = None, **kw: Any) -> subprocess.CompletedProcess:
    """``loom <args>`` in a subprocess, killed (failing the test) if it outlives ``timeout``."""
    return subprocess.run([*LOOM, *args], capture_output=True, text=True, timeout=timeout, env=job_env(env), cwd=ROOT, **kw)


def start_nodes(nnodes: int, nproc: int, script_args: list[str], timeout: float = 60.0) -> list[subprocess.Popen]:
    """``nnodes`` ``loom run`` agents on localhost forming one job, as separate machines would."""
    master = f"127.0.0.1:{free_port()}"
    env = job_env()
    return [
        subprocess.Popen(
            [*LOOM, "run", "--nnodes", str(nnodes), "--node-rank", str(node), "--master", master,
             "--nproc", str(nproc), "--timeout", str(timeout), *script_args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in range(nnodes)
    ]  # fmt: skip


def wait_all(procs: list[subprocess.Popen], timeout: float = 120.0) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each process; one that outlives ``timeout`` is killed (its
    whole process group when it leads one), so the test fails on its code, with its output."""
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, 9)
            else:
                proc.kill()
        results.append((proc.wait(), *proc.communicate()))
    return results


def read_progress(out: Path) -> list[tuple[int, int, int]]:
    """The (attempt or worker, pid, step) lines a test script appended to ``OUT.progress``."""
    path = out.with_name(out.name + ".progress")
    words = path.read_text().split() if path.exists() else []
    return [tuple(map(int, words[i : i + 3])) for i in range(0, len(words) - 2, 3)]
