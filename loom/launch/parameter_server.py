"""Parameter-server jobs: ``loom run --ps N --workers M`` on one machine, or one task of a job across machines.

The workers are not one torchrun group: in asynchronous training a worker that dies must not
stop the others. Each is a process of its own, restarted on failure up to ``--max-restarts``
times; a restarted worker pulls the current parameters and goes on. Worker 0 is the chief.
Every request carries the job's token (made here for a one-machine job, ``LOOM_PS_TOKEN`` on
every machine otherwise). Across machines (any server off loopback) servers and workers speak
mutual TLS: each launcher makes its task's certificate, signed by a job authority derived from
the token (``certificates.py``), unless the cluster gives its own (``LOOM_PS_TLS_*``,
``--ps-tls-cert``/``--ps-tls-key``). Each server logs every update before it
acknowledges it and snapshots its state every few seconds, so one that dies, even by
``kill -9``, is restarted with every update a worker saw acknowledged; one that comes back
without some (its state files removed or damaged) fails the job, saying how many it lost.
When a worker dies, its launcher settles its last push (applied on every server or on none) before restarting it; when a worker is done for good its launcher
tells every server, and the servers exit once all workers are done.

A job ends when a task cannot go on: a worker's exception is named by its launcher (with its
traceback, once); the chief failing for good (its restarts spent), or a server that cannot
come back, fails the job: the launcher stops the tasks it started and tells the servers on
other machines why (``job_failure.py``), which refuse every worker from then on, so the tasks
there stop within seconds, each launcher naming the task that failed and why. A worker other
than the chief that fails for good does not stop the others (asynchronous training goes on).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from loom.cluster import ParameterServerCluster, parse_endpoint
from loom.comm.process_group import TIMEOUT_ENV
from loom.devices import cuda_count, thread_budget
from loom.errors import LaunchError, LoomError
from loom.fast import allocator
from loom.launch.parent import die_with_parent
from loom.launch.worker import ERROR_FILE_ENV
from loom.launch.zygote import WORKER, ForkedWorker, Forker

SERVER_SAVE_SECONDS = 2.0
SERVER_EXIT_GRACE = 30.0  # after the last worker, how long a one-machine job waits for its servers to exit
FAILED_JOB_PATIENCE = 3.0  # seconds a server of a failed job has to hear that a worker stopped
JOB_FAILED_BY_ANOTHER = "JobFailedError: "  # how a worker told by the servers that another task failed the job records it
TOKEN_HELP = "set the same secret in LOOM_PS_TOKEN on every machine (make one with: python -c 'import secrets; print(secrets.token_hex(16))')"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _say(message: str) -> None:
    print(f"loom: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class JobOptions:
    """How a parameter-server job trains and survives, the same for every task of it.

    Each server logs every update it acknowledges and snapshots its state every few seconds
    under ``checkpoint_dir`` (a temporary directory by default); a server or worker that dies is
    restarted up to ``max_restarts`` times.
    ``tls_cert``/``tls_key``: PEM files for TLS (else ``LOOM_PS_TLS_CERT``/``LOOM_PS_TLS_KEY``).
    ``threads``: CPU threads for each server and worker started here (``--threads``); by
    default the cores divided among this machine's workers. ``timeout``: seconds a worker
    waits for the others (the chief's variables, a round) before it fails (``--timeout``).
    """

    max_restarts: int = 0
    staleness: int | None = None
    checkpoint_dir: str | None = None
    synchronous: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    threads: int | None = None
    timeout: float | None = None

    def __post_init__(self) -> None:
        if self.staleness is not None and self.synchronous:
            raise LaunchError("--sync and --staleness exclude each other: synchronous workers are never stale")
        if self.threads is not None and self.threads < 1:
            raise LaunchError(f"--threads must be at least 1 (got {self.threads}); leave it out for cores / workers")


def run_parameter_server_job(entry: list[str], servers: int, workers: int, options: JobOptions = JobOptions()) -> int:
    """Run ``entry`` (a script and its arguments) on ``workers`` workers against ``servers``
    servers, all here; the servers listen on loopback."""
    if servers < 1 or workers < 1:
        raise LaunchError(f"a parameter-server job needs at least one server and one worker (got --ps {servers} --workers {workers})")
    cluster = [f"127.0.0.1:{_free_port()}" for _ in range(servers)]
    job = _Job(entry, cluster, workers, secrets.token_hex(16), options)
    return job.run(servers_here=list(range(servers)), workers_here=list(range(workers)))


def run_parameter_server_task(entry: list[str], cluster: ParameterServerCluster, options: JobOptions = JobOptions()) -> int:
    """Run this machine's task of a job across machines: one server, or one worker.

    A server listens on its own address from the cluster (and nowhere else) and exits when
    every worker is done; a worker's launcher ends when its worker is done for good.
    """
    token = os.environ.get("LOOM_PS_TOKEN")
    if not token:
        raise LaunchError(f"LOOM_PS_TOKEN is not set: a parameter-server job across machines admits only its own processes; {TOKEN_HELP}")
    from loom.launch.certificates import is_loopback, task_certificate

    job = _Job(entry, list(cluster.servers), cluster.workers, token, options)
    hosts = [parse_endpoint(address, what="parameter server address")[0] for address in cluster.servers]
    keys = None  # this task's certificate and private key: removed when the task ends, however it ends
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # a stopped launcher ends through the finally blocks
    try:
        if "LOOM_PS_TLS_CERT" not in job.env and not all(is_loopback(host) for host in hosts):
            here = hosts[cluster.index] if cluster.role == "ps" else socket.gethostname()
            keys = Path(tempfile.mkdtemp(prefix="loom-ps-tls-"))
            job.env.update(task_certificate(token, here, keys))
        if cluster.role == "ps":
            return job.run(servers_here=[cluster.index], workers_here=[])
        return job.run(servers_here=[], workers_here=[cluster.index])
    finally:
        if keys is not None:
            shutil.rmtree(keys, ignore_errors=True)


class _Job:
    """Starts this machine's servers and workers, restarts the ones that fail, and ends them."""

    def __init__(self, entry: list[str], servers: list[str], workers: int, token: str, options: JobOptions) -> None:
        self.entry = entry
        self.servers = servers
        self.workers = workers
        self.token = token
        self.max_restarts = options.max_restarts
        self.threads = options.threads
        self.checkpoint_dir = options.checkpoint_dir
        self.state_dir: Path  # made by run(), once the set-up has passed its checks
        self._forker = Forker() if not cuda_count() else None  # as loom run's workers (see loom.launch.zygote)
        self.worker_env: dict[str, str] = {}  # what workers get beyond ``env``, which servers get too
        self.env = {**os.environ, "LOOM_PS_TOKEN": token, "LOOM_PS_SERVERS": ",".join(servers), "LOOM_PS_WORKERS": str(workers)}
        if options.staleness is not None:
            self.env["LOOM_PS_STALENESS"] = str(options.staleness)
        if options.synchronous:
            self.env["LOOM_PS_SYNC"] = "1"
        if options.timeout is not None:
            self.env[TIMEOUT_ENV] = str(options.timeout)
        for variable, path in (("LOOM_PS_TLS_CERT", options.tls_cert), ("LOOM_PS_TLS_KEY", options.tls_key)):
            if path:
                self.env[variable] = str(Path(path).resolve())

    def _serve(self, index: int, restarted: bool) -> subprocess.Popen:
        host, port = parse_endpoint(self.servers[index], what="parameter server address")
        command = [sys.executable, "-m", "loom.strategies.parameter_server.serve", "--host", host, "--port", str(port),
                   "--index", str(index), "--workers", str(self.workers),
                   "--checkpoint", str(self.state_dir / f"server-{index}.safetensors"),
                   "--checkpoint-every", str(SERVER_SAVE_SECONDS)] + (["--restarted"] if restarted else [])  # fmt: skip
        return subprocess.Popen(command, env=self.env, preexec_fn=die_with_parent)

    def _lost(self, index: int) -> Path:
        """Where server ``index`` reports updates it came back without (``serve.py``)."""
        return self.state_dir / f"server-{index}.safetensors.lost"

    def _failed_report(self, index: int) -> Path:
        """Where server ``index`` leaves the reason another task gave for failing the job (``serve.py``)."""
        return self.state_dir / f"server-{index}.safetensors.failed"

    def _fail_job(self, reason: str, here: list[int]) -> str:
        """Tell the servers not started here (on other machines) that the job failed; the line to end on."""
        from loom.strategies.parameter_server.job_failure import tell_servers
        from loom.strategies.parameter_server.transport import TLS

        elsewhere = [a for i, a in enumerate(self.servers) if i not in here]
        missed = tell_servers(elsewhere, self.token, TLS.from_env(env=self.env), reason) if elsewhere else []
        return f"; could not tell the servers at {', '.join(missed)}: stop their tasks by hand" if missed else ""

    def _lost_updates(self, serving: dict[int, subprocess.Popen]) -> str | None:
        """Why the job fails, if a server here came back without updates a worker saw."""
        from loom.strategies.parameter_server.state_file import lost_message

        for index, proc in serving.items():
            if self._lost(index).exists():
                return f"parameter server {index} ({self.servers[index]}, pid {proc.pid}) {lost_message(json.loads(self._lost(index).read_text()))}"
        return None

    def _error_file(self, worker: int) -> Path:
        """Where worker ``worker`` records the exception it dies of (``loom.launch.worker``)."""
        return self.state_dir / f"worker-{worker}.error.json"

    def _start(self, worker: int) -> subprocess.Popen | ForkedWorker:
        """Worker ``worker``, forked from the zygote where it can be (``loom.launch.zygote``), else a new
        process; either ends when this launcher dies. (Servers start as new processes, named in ``ps``.)"""
        self._error_file(worker).unlink(missing_ok=True)
        env = {**self.env, **self.worker_env, "LOOM_PS_WORKER": str(worker), ERROR_FILE_ENV: str(self._error_file(worker))}
        forked = self._forker.fork(list(self.entry), env, die_with_parent=True) if self._forker is not None else None
        return forked or subprocess.Popen([sys.executable, "-m", WORKER, *self.entry], env=env, preexec_fn=die_with_parent)

    def _why(self, worker: int, code: int) -> str:
        """How a worker ended: the exception it recorded (its traceback printed here, once), else its code."""
        try:
            recorded = json.loads(self._error_file(worker).read_text())["message"]
            message, traceback = recorded["message"], recorded.get("extraInfo", {}).get("py_callstack", "")
        except (OSError, ValueError, KeyError, TypeError):
            return f"exited with code {code}"
        if not message.startswith(JOB_FAILED_BY_ANOTHER):  # told by the servers: the line names the task that failed
            print(traceback, end="" if traceback.endswith("\n") else "\n", file=sys.stderr, flush=True)
        return f"failed: {message}"

    def _tell_servers(self, worker: int, pid: int, code: int, finished: bool) -> None:
        """Settle a dead worker's last push; tell the servers (maybe on other machines) when it is done for good."""
        from loom.strategies.parameter_server.client import ServerClient
        from loom.strategies.parameter_server.job_failure import JobFailedError
        from loom.strategies.parameter_server.settle import settle
        from loom.strategies.parameter_server.transport import TLS
        from loom.strategies.parameter_server.variables import worker_name

        tls = TLS.from_env(env=self.env)
        clients = [ServerClient(address, self.token, deadline=10.0, patience=30.0, tls=tls) for address in self.servers]
        try:
            if code != 0:
                try:
                    for line in settle(clients, worker_name(worker, pid)):
                        _say(f"worker {worker} died mid-push: {line}")
                except JobFailedError:
                    pass  # the servers apply nothing more: there is no push to settle
            if finished:
                for client in clients:
                    client.call({"op": "finish", "worker": worker, "code": code})
        except LoomError as error:
            _say(f"could not reach the servers about worker {worker} ({error}); they serve until stopped")
        finally:
            for client in clients:
                client.close()

    def _tell_servers_the_job_failed_for(self, worker: int, code: int) -> None:
        """The job has failed: no push to settle; tell every server at once that ``worker`` stopped, within twice
        FAILED_JOB_PATIENCE in all, so that none refuses on for its grace. One that died with the job cannot hear."""
        from loom.strategies.parameter_server.client import ServerClient
        from loom.strategies.parameter_server.transport import TLS

        tls = TLS.from_env(env=self.env)
        missed: list[str] = []

        def tell(address: str) -> None:
            client = None
            try:
                client = ServerClient(address, self.token, deadline=FAILED_JOB_PATIENCE, patience=FAILED_JOB_PATIENCE, tls=tls)
                client.call({"op": "finish", "worker": worker, "code": code})
            except Exception:  # noqa: BLE001 - whatever it was, that server did not hear; named below
                missed.append(address)
            finally:
                if client is not None:
                    client.close()

        threads = [threading.Thread(target=tell, args=(address,), daemon=True) for address in self.servers]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 2 * FAILED_JOB_PATIENCE
        for thread, address in zip(threads, self.servers):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                missed.append(address)
        if missed:
            _say(f"the servers at {', '.join(sorted(set(missed)))} did not hear that worker {worker} stopped (gone with the job?)")

    def run(self, servers_here: list[int], workers_here: list[int]) -> int:
        from loom.strategies.parameter_server.job_failure import JOB_FAILED, PREFIX
        from loom.strategies.parameter_server.transport import TLS, message_limit

        TLS.from_env(server=bool(servers_here), env=self.env)  # a half-set or unreadable TLS set-up fails here, in one line
        message_limit(self.env)  # and so does a bad bound on requests
        self.state_dir = Path(self.checkpoint_dir or tempfile.mkdtemp(prefix="loom-ps-"))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for index in servers_here:  # reports of an earlier run: this one starts from what the files hold
            self._lost(index).unlink(missing_ok=True)
            self._failed_report(index).unlink(missing_ok=True)
        threads = str(self.threads or thread_budget(len(workers_here)))
        self.env.update(OMP_NUM_THREADS=threads, LOOM_THREADS=threads)
        if self._forker is not None:  # workers keep freed memory for the next step, as loom run's (loom.fast.allocator)
            self.worker_env.update(allocator.launcher_environment(os.environ))
            self._forker.start_early({**self.env, **self.worker_env})  # before a server or worker starts, while no thread runs
        serving = {i: self._serve(i, restarted=False) for i in servers_here}
        server_restarts = dict.fromkeys(serving, 0)
        running = {w: self._start(w) for w in workers_here}
        restarts = dict.fromkeys(running, 0)
        failed: dict[int, str] = {}  # worker -> how it ended, for good
        workers_done_at: float | None = None
        try:
            while running or serving:
                time.sleep(0.2)
                for i, proc in list(serving.items()):
                    code = proc.poll()
                    if code is None:
                        continue
                    if code == 0:
                        del serving[i]
                        continue  # every worker is done
                    if code == JOB_FAILED:
                        _say(f"job failed: {self._failed_report(i).read_text()}; parameter server {i} stopped")
                        return 1
                    where = f"parameter server {i} ({self.servers[i]}, pid {proc.pid}) exited with code {code}"
                    failure = self._lost_updates({i: proc}) or (where if server_restarts[i] >= self.max_restarts else None)
                    if failure:
                        _say(f"job failed: {failure}{self._fail_job(failure, servers_here)}")
                        return 1
                    del serving[i]
                    server_restarts[i] += 1
                    _say(f"{where}; restarting it from its checkpoint ({server_restarts[i]} of {self.max_restarts}); the workers wait for it")
                    serving[i] = self._serve(i, restarted=True)
                for worker, proc in list(running.items()):
                    code = proc.poll()
                    if code is None:
                        continue
                    failure = self._lost_updates(serving)  # reported before any worker could die of it
                    if failure:
                        _say(f"job failed: {failure}{self._fail_job(failure, servers_here)}")
                        return 1
                    del running[worker]
                    why = self._why(worker, code) if code != 0 else ""
                    if why.startswith(f"failed: {JOB_FAILED_BY_ANOTHER}"):  # no restart: the job is over
                        self._tell_servers_the_job_failed_for(worker, code)
                        _say(f"job failed: {why.split(PREFIX, 1)[-1].removesuffix('; this worker stops')}; worker {worker} stopped")
                        return 1
                    again = code != 0 and restarts[worker] < self.max_restarts
                    self._tell_servers(worker, proc.pid, code, finished=not again)
                    if again:
                        restarts[worker] += 1
                        _say(f"worker {worker} (pid {proc.pid}) {why}; restarting it ({restarts[worker]} of {self.max_restarts}), the others go on")
                        running[worker] = self._start(worker)
                        continue
                    if code != 0 and worker == 0:  # no chief: nobody creates, restores or saves the variables
                        stopped = "; stopping this job's other tasks here" if running or serving else ""
                        chief = f"worker 0, the chief (pid {proc.pid} on {socket.gethostname()}), {why}"
                        _say(f"job failed: {chief}{stopped}{self._fail_job(chief, servers_here)}")
                        return 1
                    if code != 0:
                        failed[worker] = why
                if workers_here and not running:
                    workers_done_at = workers_done_at or time.monotonic()
                    if time.monotonic() - workers_done_at > SERVER_EXIT_GRACE:
                        break  # the servers missed a worker's end: stop them below (they save first)
        finally:
            for proc in [*running.values(), *serving.values()]:
                if proc.poll() is None:
                    proc.terminate()  # servers save their state on SIGTERM
            for proc in [*running.values(), *serving.values()]:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
            if self.checkpoint_dir is None:  # this run's own temporary directory, named to no one: nothing resumes from it
                shutil.rmtree(self.state_dir, ignore_errors=True)
            if self._forker is not None:
                self._forker.close()
        if failed:
            listed = "; ".join(f"worker {w} {why}" for w, why in sorted(failed.items()))
            others = "; the other workers completed" if len(workers_here) > len(failed) else ""
            _say(f"job finished with failures: {listed}{others}")
            return 1
        return 0
