"""Workers forked from one interpreter that has imported torch: a start or restart costs milliseconds.

Each worker of ``loom run`` would be a new Python that imports torch and loom, about two
CPU-seconds, and each restart would pay it again. Instead, the node's first worker start launches
the zygote, ``python -u -m loom.launch.worker --zygote ...``, with that worker's environment; it
imports torch and loom once, then forks every worker of the node: the child takes its own
environment, output files, working directory and session, and runs ``loom.launch.worker`` as a
new process would. The zygote reports each worker's exit status, so to torch's agent a forked
worker is a ``Popen`` like any other (``ForkedWorker``). Forked workers keep the zygote's command
line and, in /proc, its environment (the first worker's: the job's MASTER_ADDR and MASTER_PORT),
by which ``loom stacks`` finds a job.

A launcher whose own interpreter started as a worker's would (``python -u -m loom.launch.cli``,
and the variables read at start that the workers are given) is that interpreter already: it
forks the zygote from itself, before torch's agent starts a thread, and a node's start imports
torch once, not twice. The test suite starts its launchers so; the ``loom`` command does not. Their workers keep the launcher's command line and start
environment instead, and ``loom stacks`` finds them by the registry of loom processes.

A worker whose environment differs from the zygote's in a variable read only when a process
starts (the allocator's, the dynamic loader's, Python's, OpenMP's) starts as a new process, and so
does every worker under ``LOOM_FORK_WORKERS=0``.
"""

from __future__ import annotations

import os
import pickle
import queue
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import IO, Any, Iterator

from loom.comm.ring import pid_alive
from loom.launch.parent import die_with_parent

FORK_ENV = "LOOM_FORK_WORKERS"
WORKER = "loom.launch.worker"  # every worker starts (and ends) through it
# Read once, when a process starts: a worker that needs other values than the zygote's starts fresh.
READ_AT_START = ("MALLOC_", "GLIBC_TUNABLES", "LD_", "PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH_LOGS")
PRELOAD = ("torch", "torch.distributed", "loom", WORKER, "loom.strategies.data_parallel.mirrored", "loom.checkpoint.checkpointer", "loom.train")
_MESSAGE = 1 << 20  # the largest request (a worker's environment) or report the socket carries
_LAUNCHER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
READY_WAIT = 120.0  # seconds a start waits for the zygote's imports before starting a new process instead
# What this interpreter read when it started: os.environ when loom is imported (nothing in loom sets these
# before). A forked process inherits it, whatever it puts in os.environ. (/proc/self/environ cannot
# say: glibc cuts GLIBC_TUNABLES there as it parses it.)
STARTED_WITH = {name: value for name, value in os.environ.items() if name.startswith(READ_AT_START)}


def compatible(env: dict[str, str], zygote_env: dict[str, str]) -> bool:
    """Whether a worker with ``env`` may be forked: it reads nothing at start that differs from the zygote's."""
    names = {n for n in (*env, *zygote_env) if n.startswith(READ_AT_START)}
    return all(env.get(n) == zygote_env.get(n) for n in names)


LAUNCHERS = ("loom.launch.cli", "loom.launch.groups")  # programs that run no user code before they start workers


def started_as_worker(env: dict[str, str]) -> bool:
    """Whether this process may become its workers' zygote: loom's own launcher (no user code has
    run: no module state, atexit handler or open file of the user's to pass on), with no other
    thread, its interpreter started as a worker with ``env`` would (``python -u`` and no other
    switch, the same variables read at start), and torch imported (else forking saves nothing)."""
    switches = []
    for arg in sys.orig_argv[1:]:
        if not arg.startswith("-") or arg in ("-m", "-c", "-"):
            break
        switches.append(arg)
    main = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
    return (switches == ["-u"] and main in LAUNCHERS and threading.active_count() == 1 and "torch" in sys.modules
            and compatible(env, STARTED_WITH))  # fmt: skip


def enabled() -> bool:
    """Whether workers are forked from a zygote (``LOOM_FORK_WORKERS``, default 1; Linux only)."""
    return sys.platform == "linux" and os.environ.get(FORK_ENV, "1") != "0"


class ForkedWorker:
    """A worker forked by the zygote, with the part of ``subprocess.Popen`` torch's agent uses."""

    def __init__(self, zygote: Zygote, pid: int, args: tuple) -> None:
        self._zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # ended and reaped; the zygote's report is on its way

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The agent's side: starts the zygote, asks it for workers and hears their exits."""

    def __init__(self, env: dict[str, str], itself: bool = False) -> None:
        """``itself``: fork the zygote from this process where it can be (``started_as_worker``)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._process: subprocess.Popen | _Child
        if itself and started_as_worker(env):
            self.env, self._process = STARTED_WITH, _fork_zygote(theirs.fileno())
        else:
            self.env = env
            self._process = subprocess.Popen(
                [sys.executable, "-u", "-m", WORKER, "--zygote", str(theirs.fileno()), str(os.getpid())], env=env, pass_fds=[theirs.fileno()]
            )
        theirs.close()
        self._socket = ours
        self._asking = threading.Lock()  # one fork request at a time
        self._started: queue.Queue[tuple[int, int | None] | None] = queue.Queue()  # (request, pid)
        self._requests = 0
        self._exits: dict[int, int] = {}
        self._changed = threading.Condition()
        self._ready = threading.Event()
        self._ready_by = time.monotonic() + READY_WAIT
        self._gone = False
        threading.Thread(target=self._hear, name="loom-zygote", daemon=True).start()

    def start(self, argv: list[str], env: dict[str, str], stdout: IO | None, stderr: IO | None, new_session: bool,
              die_with_parent: bool, cwd: str | None = None) -> ForkedWorker | None:  # fmt: skip
        """Fork a worker running ``loom.launch.worker argv`` in ``cwd`` (default: ours); None when the
        zygote cannot (it is gone).

        ``new_session`` as ``Popen``'s ``start_new_session``; ``die_with_parent``: SIGTERM when the
        zygote dies, which dies with its launcher."""
        with self._asking:
            while not self._ready.wait(1.0):
                if self._gone or self._process.poll() is not None or time.monotonic() > self._ready_by:
                    return None  # a new process instead; the zygote serves later starts once ready
            if self._gone:
                return None
            self._requests += 1
            request = {"id": self._requests, "argv": argv, "env": env, "cwd": os.path.abspath(cwd or os.getcwd()),
                       "stdout": stdout is not None, "stderr": stderr is not None, "new_session": new_session,
                       "die_with_parent": die_with_parent}  # fmt: skip
            try:
                socket.send_fds(self._socket, [pickle.dumps(request)], [f.fileno() for f in (stdout, stderr) if f is not None])
            except OSError:
                return None
            while (answer := self._started.get()) is not None and answer[0] != self._requests:
                pass  # a start interrupted after its request was sent (a signal's exception) left its answer
            pid = answer[1] if answer is not None else None
        return ForkedWorker(self, pid, (sys.executable, "-m", WORKER, *argv)) if pid is not None else None

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The worker's exit code (negative: the signal that ended it); None while it runs after ``timeout``.

        A worker orphaned by the zygote's death is watched in /proc until it ends; its status died
        with the zygote, and it is reported as killed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._gone, timeout)
            if pid in self._exits:
                return self._exits[pid]
        while self._gone:
            if not pid_alive(pid):
                return -signal.SIGKILL
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        return None

    def close(self) -> None:
        """End the zygote (its workers were stopped by the agent)."""
        self._socket.shutdown(socket.SHUT_RDWR)  # the zygote reads the end; close alone would wait for our reader
        self._socket.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _hear(self) -> None:
        try:
            while True:
                try:
                    message = self._socket.recv(_MESSAGE)
                except OSError:
                    message = b""
                if not message:
                    return
                kind, *rest = pickle.loads(message)  # our own zygote's, over a socket pair no one else holds
                if kind == "ready":
                    self._ready.set()
                elif kind == "started":
                    with self._changed:
                        self._exits.pop(rest[1], None)  # a pid used again: the earlier worker's status is not this one's
                    self._started.put((rest[0], rest[1]))
                else:
                    with self._changed:
                        self._exits[rest[0]] = rest[1]
                        self._changed.notify_all()
        finally:
            with self._changed:
                self._gone = True
                self._changed.notify_all()
            self._started.put(None)


class _Child:
    """A forked zygote, with the part of ``Popen`` the agent's side uses."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def _fork_zygote(fd: int) -> _Child:
    """The zygote forked from this process (``started_as_worker``), serving socket ``fd``."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    launcher = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            _forget_launcher(keep=fd)
            serve(fd, launcher)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(0)
    return _Child(pid)


def _forget_launcher(keep: int) -> None:
    """In a zygote forked from its launcher: the signal dispositions a new interpreter has, and none
    of the launcher's files or sockets held open (its store's port, its pipes). Each descriptor is
    pointed at /dev/null rather than closed, so that a launcher object collected here closes no
    number used again."""
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 2 and int(name) not in (keep, null):
            os.dup2(null, int(name))


class Forker:
    """Starts ``python -m loom.launch.worker ARGS`` processes for one launcher, forked from its zygote
    (made with the first one's environment) where it can."""

    def __init__(self, start_with: dict[str, str] | None = None) -> None:
        """``start_with``: variables its zygote (and so what it forks) starts with beyond each request's
        environment, which the forked process's ``os.environ`` leaves out (a test starting launchers
        as their workers will start)."""
        self._zygote: Zygote | None = None
        self._making = threading.Lock()
        self._start_with = start_with or {}

    def start_early(self, env: dict[str, str]) -> None:
        """Make the zygote now, for workers with ``env``: where this interpreter started as they would,
        by forking it, while no thread is running that a fork would leave holding a lock."""
        if enabled() and started_as_worker(env):
            with self._making:
                if self._zygote is None:
                    self._zygote = Zygote(env, itself=True)

    def fork(self, argv: list[str], env: dict[str, str], stdout: IO | None = None, stderr: IO | None = None,
             new_session: bool = False, die_with_parent: bool = False, cwd: str | None = None) -> ForkedWorker | None:  # fmt: skip
        """The forked worker; None where it must start as a new process (see the module)."""
        if not enabled():
            return None
        started = {**env, **self._start_with}
        with self._making:
            if self._zygote is None:
                self._zygote = Zygote(started)
        if not compatible(started, self._zygote.env):
            return None
        return self._zygote.start(argv, env, stdout, stderr, new_session, die_with_parent, cwd)

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()


@contextmanager
def forked_workers(cpu: bool) -> Iterator[None]:
    """torch's agent, run in this block, starts its workers from a zygote when it can (see the module).

    On CPU only: a process that forks after initialising the CUDA driver leaves its children
    without it, and there the start-up is a small part of a job's time.
    """
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    from loom.compat import worker_handlers

    forker = Forker()
    if cpu:
        forker.start_early(dict(os.environ))  # what the agent gives each worker, and its rank's variables

    class Handler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            if cpu and tuple(args[:4]) == (sys.executable, "-u", "-m", WORKER):
                worker = forker.fork(list(args[4:]), env, self._stdout, self._stderr, new_session=True)
                if worker is not None:
                    return worker
            return super()._popen(args, env)

        def close(self, death_sig: signal.Signals | None = None) -> None:
            try:
                super().close(death_sig)
            except ProcessLookupError:  # the zygote reaped it and its group is empty: a Popen child would still be a zombie
                for output in (self._stdout, self._stderr):
                    if output is not None:
                        output.close()

    try:
        with worker_handlers(Handler):
            yield
    finally:
        forker.close()


# ---- the zygote -----------------------------------------------------------------------------------
def serve(fd: int, parent: int) -> None:
    """The zygote: import torch and loom, then fork a worker for each request on socket ``fd``."""
    import importlib

    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:
        return
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # Ctrl-C, a SIGTERM or SIGHUP to the launcher's process group are for the launcher, which stops the
    # workers with their grace period: the zygote must live to report how they ended. It ends with the
    # launcher (PDEATHSIG) or when the launcher is done. A child takes back the dispositions it had.
    inherited = {s: signal.signal(s, signal.SIG_IGN) for s in _LAUNCHER_SIGNALS}
    channel = socket.socket(fileno=fd)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    channel.send(pickle.dumps(("ready",)))
    while True:
        readable, _, _ = select.select([channel, wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
            _reap(channel)
        if channel in readable:
            message, fds, _, _ = socket.recv_fds(channel, _MESSAGE, 2)
            if not message:
                return  # the agent is done
            request, zygote = pickle.loads(message), os.getpid()
            try:
                pid = os.fork()
            except OSError:  # no memory or processes left: the launcher starts a new process, or says why
                for fd in fds:
                    os.close(fd)
                channel.send(pickle.dumps(("started", request["id"], None)))
                continue
            if pid == 0:
                _become_worker(request, fds, [channel.fileno(), wake_read, wake_write], zygote, inherited)
            for fd in fds:
                os.close(fd)
            channel.send(pickle.dumps(("started", request["id"], pid)))


def _reap(channel: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        channel.send(pickle.dumps(("exited", pid, os.waitstatus_to_exitcode(status))))


def _become_worker(request: dict[str, Any], fds: list[int], zygote_fds: list[int], zygote: int, inherited: dict[int, Any]) -> None:
    """In the forked child: become the worker a new process would be, then run it; never returns."""
    try:
        if request["new_session"]:
            os.setsid()  # torch's agent signals the worker's process group
        if request["die_with_parent"]:
            die_with_parent(signal.SIGTERM)
            if os.getppid() != zygote:  # it died before that took effect
                os._exit(1)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sig, disposition in inherited.items():
            signal.signal(sig, disposition)
        for fd in zygote_fds:
            os.close(fd)
        for target, fd in zip([t for t, given in ((1, request["stdout"]), (2, request["stderr"])) if given], fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if "numpy" in sys.modules:  # a new process seeds numpy's global generator from the OS; forked ones would share it
            sys.modules["numpy"].random.seed()
        from loom.launch import worker

        worker.main(request["argv"])
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)

