"""Start this node's share of a job with torchrun's elastic agent, called in-process.

Everything about the cluster is decided here once (processes per node, rendezvous, thread
budget, collective timeout) and handed to the workers through torchrun's environment.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import socket
import struct
import sys
from dataclasses import dataclass, field

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from loom.cluster import NodeSpec, resolve_node
from loom.compat import run_torchrun, torchrun_accepts
from loom.checkpoint.arrival import resolve_wait
from loom.comm.groups import ADDRESS_ENV, GROUP_ENV
from loom.comm.health import resolve_hang_check, resolve_silence_limit
from loom.comm.process_group import TIMEOUT_ENV, resolve_timeout
from loom.devices import HOST_PROCESSES_ENV, THREADS_ENV, check_nproc, cuda_count, default_nproc, default_nproc_reason, thread_budget
from loom.errors import LaunchError
from loom.fast import allocator
from loom.launch.agent import reporting_agent, wait_report_interval
from loom.launch.zygote import WORKER, forked_workers
from loom.launch.failures import report
from loom.strategies.base import LAYOUT_ENV


# Seconds the agent waits for workers to exit after SIGTERM before it kills them. (torch's
# agent applies it when it is itself signalled; after a worker failure it waits its own 30 s,
# which only a stuck worker ever uses: loom's workers exit at once.)
SHUTDOWN_GRACE = 10


@dataclass
class LaunchOptions:
    """How to start a job; each field's help is the CLI's."""

    nproc: int | None = field(default=None, metadata={"help": "processes (replicas) on this node; default: one per GPU, else one per core (at most 8), one per worker under TF_CONFIG"})
    nnodes: int | None = field(default=None, metadata={"help": "number of nodes (machines) in the job"})
    node_rank: int | None = field(default=None, metadata={"help": "this node's rank, 0 .. nnodes-1; node 0 hosts the rendezvous"})
    master: str | None = field(default=None, metadata={"help": "HOST:PORT of node 0's rendezvous, the same on every node"})
    threads: int | None = field(default=None, metadata={"help": "CPU threads per process; default: cores / processes on this node"})
    timeout: float | None = field(default=None, metadata={"help": "seconds a collective may wait before the job fails naming the missing rank"})
    max_restarts: int = field(default=0, metadata={"help": "times torch elastic restarts the workers after a failure"})

    def node(self) -> NodeSpec:
        return resolve_node(self.nnodes, self.node_rank, self.master)

    def processes(self) -> int:
        """Processes on this node: the flag, else the default for the machine and the cluster."""
        return self._processes()[0]

    def _processes(self) -> tuple[int, str]:
        if self.nproc:
            return self.nproc, f"--nproc {self.nproc}"
        if self.node().source == "TF_CONFIG" and not cuda_count():
            # A TF worker is one replica on CPU; TF users size their batches for that.
            return 1, "TF_CONFIG: one process per worker on CPU; --nproc N to change"
        return default_nproc(), f"{default_nproc_reason()}; --nproc N to change"

    def replicas(self) -> str:
        """How many replicas the job will have under a data-parallel strategy, and why (``loom env``)."""
        return f"{_count(self.node().nnodes * self.processes(), 'replica')} = {self.layout()}"

    def layout(self) -> str:
        """The processes and why so many; the job's first line, which its strategy's chief prints,
        puts the replicas (and model-parallel degrees) before it."""
        nproc, why = self._processes()
        return f"{_count(self.node().nnodes, 'node')} x {_count(nproc, 'process', 'es')} ({why})"

    def threads_per_process(self) -> int:
        return self.threads or thread_budget(self.processes_on_host())

    def processes_on_host(self) -> int:
        """This node's processes times the nodes of the job on this host (TF_CONFIG's workers on one machine)."""
        node = self.node()
        if not node.hosts:
            return self.processes()
        mine = node.hosts[node.node_rank]
        here = sum(1 for host in node.hosts if host == mine or (_is_local(host) and _is_local(mine)))
        return self.processes() * here


def _count(n: int, noun: str, suffix: str = "s") -> str:
    return f"{n} {noun}{suffix if n != 1 else ''}"


def name_resolves() -> bool:
    """Whether this host's names resolve to an address (in a container or namespace they may not, even here)."""
    try:
        for name in {socket.gethostname(), socket.getfqdn()}:
            socket.gethostbyname(name)
    except OSError:
        return False
    return True


def _is_local(host: str) -> bool:
    if host in ("localhost", "0.0.0.0", "::1") or host.startswith("127."):
        return True
    try:
        return socket.gethostbyname(host) in {"127.0.0.1", socket.gethostbyname(socket.gethostname())}
    except OSError:
        return False


def check_port_free(host: str, port: int) -> None:
    """Fail before the agent does, with a line a person can act on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise LaunchError(
                f"port {port} on {host} is already in use (another job?); pass a free one with "
                f"--master {host}:PORT, or stop the process holding it"
            ) from None


def torchrun_argv(opts: LaunchOptions, entry: list[str]) -> list[str]:
    """The torchrun command line for ``entry`` (``[script, args...]`` or ``['-m', module, args...]``)."""
    node = opts.node()
    nproc = opts.processes()
    check_nproc(nproc)
    argv = ["--nproc-per-node", str(nproc), "--max-restarts", str(opts.max_restarts)]
    if torchrun_accepts("--shutdown-timeout"):  # older torch waits its own 30 s
        argv += ["--shutdown-timeout", str(SHUTDOWN_GRACE)]
    if node.nnodes == 1 and node.master_port is None:
        argv += ["--standalone"]
    else:
        if node.node_rank == 0 and _is_local(node.master_addr):
            check_port_free(node.master_addr, node.master_port)
        argv += [
            "--nnodes", str(node.nnodes),
            "--node-rank", str(node.node_rank),
            "--master-addr", node.master_addr,
            "--master-port", str(node.master_port),
        ]  # fmt: skip
    local = (os.environ.get(ADDRESS_ENV) if GROUP_ENV in os.environ else None) or (None if node.nnodes > 1 or name_resolves() else "127.0.0.1")
    if local and torchrun_accepts("--local-addr"):  # the workers' MASTER_ADDR: else this host's name, which may not resolve
        argv += ["--local-addr", local]
    return argv + ["-m", WORKER] + entry


def worker_environment(opts: LaunchOptions) -> dict[str, str]:
    """Variables every worker inherits: its thread budget, the collective timeout and, on CPU,
    glibc's tunables that keep freed memory for the next step (exact; ``loom.fast.allocator``).

    ``--threads`` is passed as is; otherwise (``auto``) each worker divides the cores itself
    (``devices.apply_thread_budget``), among this host's processes that it can count.
    """
    threads = opts.threads_per_process()
    env = {"OMP_NUM_THREADS": str(threads), THREADS_ENV: str(opts.threads or "auto"),
           HOST_PROCESSES_ENV: str(opts.processes_on_host()), LAYOUT_ENV: opts.layout()}  # fmt: skip
    if not cuda_count():  # activations in host memory
        env.update(allocator.launcher_environment(os.environ))
    if opts.timeout is not None:
        env[TIMEOUT_ENV] = str(opts.timeout)
    node = opts.node()
    if node.nnodes > 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = interface_towards(node.master_addr)
        if interface:  # else gloo binds to what the hostname resolves to, often loopback
            env["GLOO_SOCKET_IFNAME"] = interface
    return env


def interface_towards(address: str) -> str | None:
    """The network interface this host reaches ``address`` through.

    Gloo listens on the address its hostname resolves to, and falls back to loopback when the
    name does not resolve: the other nodes then cannot connect ("Connection refused"). The
    interface that routes to the master is the one the other nodes can reach.
    """
    local = address_towards(address)
    return next((name for name, ip in interface_addresses().items() if ip == local), None) if local else None


def address_towards(address: str) -> str | None:
    """This host's IPv4 address on the route to ``address``, or None where there is no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # UDP: picks the route, sends nothing
            return probe.getsockname()[0]
    except OSError:
        return None


def interface_addresses() -> dict[str, str]:
    """Each network interface's IPv4 address, by the interface's name (Linux's ``SIOCGIFADDR``);
    interfaces without one are left out."""
    found = {}
    try:
        names = socket.if_nameindex()
    except OSError:
        return found
    for _, name in names:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        found[name] = socket.inet_ntoa(packed[20:24])
    return found


def check_timeouts(opts: LaunchOptions) -> None:
    """Refuse, in one line naming it, a timeout the workers would read that cannot bound a wait
    (``nan`` would switch it off; garbage would fail every rank with a traceback)."""
    resolve_timeout(opts.timeout, "--timeout")
    for resolve in (resolve_silence_limit, resolve_hang_check, resolve_wait, wait_report_interval):
        resolve()


def run_job(entry: list[str], opts: LaunchOptions, layout: str | None = None) -> int:
    """Run this node's workers to completion; returns the exit code for the launching process.

    ``layout`` replaces the processes' part of the job's first line (a replica group says which it is).
    """
    check_timeouts(opts)
    argv = torchrun_argv(opts, entry)
    wait_report = wait_report_interval()
    workers = worker_environment(opts)
    before = {name: os.environ.get(name) for name in (LAYOUT_ENV, "GLIBC_TUNABLES")}
    os.environ.update(workers)
    if layout is not None:
        os.environ[LAYOUT_ENV] = layout
    node = opts.node()
    world_size = node.nnodes * opts.processes()
    hung: dict[int, str] = {}  # ranks the agent had to kill after the others named them hung
    try:
        # The zygote first: where it is forked from this process, it carries nothing the agent sets up here.
        with forked_workers(cpu=not cuda_count()), reporting_agent(node, world_size, wait_report, hung):
            # torchrun's own logging repeats what loom.launch.failures says in one line.
            logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
            run_torchrun(argv)
    except ChildFailedError as error:
        print(report(error.failures, world_size, "job failed", hung), file=sys.stderr, flush=True)
        return 1
    except SignalException as stop:  # the agent has stopped the workers (SIGTERM, then SIGKILL)
        name = signal.Signals(stop.sigval).name
        print(f"loom: stopped by {name}; workers terminated", file=sys.stderr, flush=True)
        return 128 + stop.sigval
    finally:  # the workers' first line and allocator: code after loom.launch() is not one of them
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0
