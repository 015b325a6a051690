"""The processes a test starts: N gloo ranks of a function (``run_ranks``), ``loom`` commands and
Python programs (``popen``, ``run``, ``loom_run``, ``start_nodes``), each bounded by a timeout.

They are forked from one zygote per test process, which has imported torch and loom
(``loom.launch.zygote``, as ``loom run`` starts its workers), and run as a new process would."""

from __future__ import annotations

import gc
import io
import itertools
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Callable

import torch.distributed as dist

from loom.devices import thread_budget
from loom.fast import allocator
from loom.launch.zygote import WORKER, Forker

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
LOOM = [sys.executable, "-m", "loom.launch.cli"]


_PORT_SPAN = 2000  # ports of each xdist worker's own, below the kernel's ephemeral range (32768 on)
_next_port = itertools.count()


def free_port() -> int:
    """A port nothing listens on, for a job the test starts next.

    Not one the kernel picked (``bind(0)``): it hands the same range to outgoing connections, and another
    test's client could hold the port by the time the job binds it. Each test process takes its ports in
    turn from a span of its own (``PYTEST_XDIST_WORKER``), below that range.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = 12000 + (int(worker) if worker.isdigit() else 0) % 10 * _PORT_SPAN
    for _ in range(_PORT_SPAN):
        port = base + next(_next_port) % _PORT_SPAN
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or just released by a job
            return port
    raise RuntimeError(f"no free port in {base}-{base + _PORT_SPAN - 1}")


_FORKER = Forker()  # this test process's zygote: what a test starts does not import torch again


# ``loom run`` launchers are forked from a zygote started as their workers start (two processes on this
# host, loom's allocator tunables): each launcher is then its workers' zygote
# (``loom.launch.zygote.started_as_worker``) and a job imports torch in no process of its own. A
# launcher's ``os.environ`` is the one asked for, as from a shell.
_LAUNCHERS = Forker(start_with={"OMP_NUM_THREADS": str(thread_budget(2)), **allocator.launcher_environment({})})


class _Output:
    """This process's stdout or stderr as the zygote passes it on: the descriptor, whatever pytest put there."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd


def _start_rank(directory: Path, rank: int, world: int, port: int) -> Any:
    env = {**job_env(), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True", "LOOM_THREADS": "1"}  # fmt: skip
    argv = ["-m", "tests.rank", str(directory), str(rank)]
    forked = _FORKER.fork(argv, env, _Output(1), _Output(2), die_with_parent=True)
    return forked or subprocess.Popen([sys.executable, "-m", WORKER, *argv], env=env, cwd=ROOT)


def _result(directory: Path, rank: int, code: int | None) -> Any:
    path = directory / f"{rank}.result"
    if not path.exists():
        raise AssertionError(f"rank {rank} exited with {code} and left no result")
    ok, value = pickle.loads(path.read_bytes())
    if not ok:
        raise AssertionError(f"rank {rank} failed:\n{value}")
    return value


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """``fn(*args)`` on ``world`` ranks set up as torchrun would; returns results by rank.

    The ranks are forked as ``loom run``'s workers are, and run through ``loom.launch.worker``.
    The parent hosts the job's store, as torchrun's agent does. A rank's exception is re-raised
    here with its traceback as soon as it ends (the others are killed); a rank that does not
    finish within ``timeout`` fails the test.
    """
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory(prefix="ranks-") as temp:
        directory = Path(temp)
        (directory / "call.pkl").write_bytes(pickle.dumps((fn, args)))
        procs = [_start_rank(directory, rank, world, port) for rank in range(world)]
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        try:
            while len(results) < world:
                for rank, proc in enumerate(procs):
                    if rank not in results and proc.poll() is not None:
                        results[rank] = _result(directory, rank, proc.returncode)  # a failed rank fails the test now
                if len(results) < world:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank(s) {sorted(set(range(world)) - set(results))} did not finish within {timeout}s")
                    time.sleep(0.05)
            return [results[rank] for rank in range(world)]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            del store


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a job a test starts: this checkout importable, no inherited TF_CONFIG."""
    inherited = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}  # only an explicit one counts
    return {**inherited, "PYTHONPATH": str(ROOT), **(extra or {})}


class Launched:
    """A ``loom`` command forked from this test process's zygote, with the part of ``Popen`` tests use."""

    def __init__(self, worker: Any, args: list[str], stdout: IO | None, stderr: IO | None) -> None:
        self._worker, self.args, self.pid = worker, args, worker.pid
        self.stdout, self.stderr = stdout, stderr
        self._read: dict[str, Any] = {}
        self._readers: list[threading.Thread] | None = None

    @property
    def returncode(self) -> int | None:
        return self._worker.returncode

    def poll(self) -> int | None:
        return self._worker.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._worker.wait(timeout)

    def send_signal(self, sig: int) -> None:
        self._worker.send_signal(sig)

    def terminate(self) -> None:
        self._worker.terminate()

    def kill(self) -> None:
        self._worker.kill()

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """As ``Popen.communicate``: both pipes read to their ends, then the exit waited for.
        Raises ``TimeoutExpired`` carrying what was read so far."""
        if self._readers is None:
            self._readers = [threading.Thread(target=self._drain, args=(name, pipe), daemon=True)
                             for name, pipe in (("stdout", self.stdout), ("stderr", self.stderr)) if pipe is not None]  # fmt: skip
            for reader in self._readers:
                reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(deadline - time.monotonic(), 0))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0, *self._so_far())
        if isinstance(failed := self._read.get("error"), Exception):
            raise failed
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 0))
        return self._so_far()

    def _so_far(self) -> tuple[Any, Any]:
        return self._joined("stdout", self.stdout), self._joined("stderr", self.stderr)

    def _joined(self, name: str, pipe: IO | None) -> Any:
        if name not in self._read:
            return None
        return ("" if isinstance(pipe, io.TextIOBase) else b"").join(self._read[name])

    def _drain(self, name: str, pipe: IO) -> None:
        chunks = self._read[name] = []
        with pipe:
            try:
                while chunk := pipe.read1(65536) if hasattr(pipe, "read1") else pipe.readline():
                    chunks.append(chunk)
            except Exception as error:  # a decoding error: communicate raises it, as Popen's does
                self._read["error"] = error


def popen(args: list[str], *, cwd: Path | str = ROOT, env: dict[str, str] | None = None, stdout: Any = None, stderr: Any = None,
          text: bool = False, start_new_session: bool = False) -> Any:  # fmt: skip
    """``subprocess.Popen(args, ...)``. ``python SCRIPT ...``, ``python -m MODULE ...`` and ``loom``
    commands are forked from this test process's zygote (``loom.launch.zygote``: it has imported
    torch) and run through ``loom.launch.worker`` as a new process would run them."""
    if args[:1] == [sys.executable] and len(args) > 1 and (args[1] == "-m" or not args[1].startswith("-")):
        out_read, out_write = _ends(stdout, 1)
        err_read, err_write = (None, out_write) if stderr == subprocess.STDOUT else _ends(stderr, 2)
        forker = _LAUNCHERS if args[1:4] == [*LOOM[1:], "run"] else _FORKER
        try:
            forked = forker.fork([str(a) for a in args[1:]], env if env is not None else dict(os.environ), out_write, err_write,
                                 new_session=start_new_session, cwd=str(cwd))  # fmt: skip
        finally:
            for end in {out_write, err_write}:
                if isinstance(end, _Pipe):
                    os.close(end.fileno())
        reads = (out_read, err_read)
        if forked is not None:
            return Launched(forked, args, *(open(read, "r" if text else "rb") if read is not None else None for read in reads))
        for read in reads:
            if read is not None:
                os.close(read)
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text, start_new_session=start_new_session)


def run(args: list[str], *, timeout: float, cwd: Path | str = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, ...)`` through ``popen``; a process that
    outlives ``timeout`` is killed and fails the test with the output it gave."""
    proc = popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise subprocess.TimeoutExpired(proc.args, timeout, *_output_after_kill(proc)) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class _Pipe(_Output):
    """A descriptor opened for a forked command (a pipe's write end, /dev/null), closed here once it has it."""


def _ends(target: Any, fd: int) -> tuple[int | None, Any]:
    """(our read end or None, what the child writes to) for ``Popen``'s ``stdout``/``stderr`` value ``target``."""
    if target == subprocess.PIPE:
        read, write = os.pipe()
        return read, _Pipe(write)
    if target == subprocess.DEVNULL:
        return None, _Pipe(os.open(os.devnull, os.O_WRONLY))
    if target is None:
        return None, _Output(fd)
    return None, target


def _output_after_kill(proc: Any) -> tuple[Any, Any]:
    """What a killed process wrote; waited for 10 s at most: processes it started, in sessions of their own, may hold its pipes."""
    try:
        return proc.communicate(timeout=10)
    except subprocess.TimeoutExpired as still:
        return still.output, still.stderr


def loom_run(args: list[str], timeout: float = 120.0, env: dict[str, str] | None = None, cwd: Path | str = ROOT) -> subprocess.CompletedProcess:
    """``loom <args>`` in a process of its own (``run``), killed (failing the test) if it outlives ``timeout``."""
    return run([*LOOM, *args], timeout=timeout, cwd=cwd, env=job_env(env))


def start_nodes(nnodes: int, nproc: int, script_args: list[str], timeout: float = 60.0) -> list[Any]:
    """``nnodes`` ``loom run`` agents on localhost forming one job, as separate machines would."""
    master = f"127.0.0.1:{free_port()}"
    env = job_env()
    return [
        popen(
            [*LOOM, "run", "--nnodes", str(nnodes), "--node-rank", str(node), "--master", master,
             "--nproc", str(nproc), "--timeout", str(timeout), *script_args],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in range(nnodes)
    ]  # fmt: skip


def wait_all(procs: list[Any], timeout: float = 120.0) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each process; one that outlives ``timeout`` is killed (its
    whole process group when it leads one), so the test fails on its code, with its output."""
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            try:
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, 9)
                else:
                    proc.kill()
            except ProcessLookupError:
                pass  # it ended meanwhile
            out, err = _output_after_kill(proc)
        results.append((proc.wait(), out, err))
    return results


def read_progress(out: Path) -> list[tuple[int, int, int]]:
    """The (attempt or worker, pid, step) lines a test script appended to ``OUT.progress``."""
    path = out.with_name(out.name + ".progress")
    words = path.read_text().split() if path.exists() else []
    return [tuple(map(int, words[i : i + 3])) for i in range(0, len(words) - 2, 3)]


def collected(ref: weakref.ref, within: float = 30.0) -> bool:
    """Collect garbage until ``ref``'s object is gone (a background thread may hold it for a moment); whether it went."""
    deadline = time.monotonic() + within
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    return ref() is None
