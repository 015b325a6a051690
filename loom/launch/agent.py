"""torchrun's elastic agent, made to say what it waits for and why it restarts.

torchrun builds its agent by name (``torch.distributed.launcher.api.LocalElasticAgent``);
``reporting_agent`` puts ``ReportingAgent``, a subclass, in its place for one job. It adds
two things torch's agent only logs, if anything: who a node is still waiting for at the
rendezvous, and each restart with its attempt number and cause.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, ContextManager

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from loom.cluster import NodeSpec, seconds_from_env
from loom.compat import elastic_agent
from loom.comm import collective_log
from loom.comm.health import FAULT_DUMP_ENV, PREFIX
from loom.errors import LaunchError
from loom.launch.failures import STOPPED, report

WAIT_REPORT_ENV = "LOOM_RENDEZVOUS_REPORT"
DEFAULT_WAIT_REPORT = 30.0


def wait_report_interval() -> float:
    """Seconds between "still waiting" lines at the rendezvous (``LOOM_RENDEZVOUS_REPORT``, default 30)."""
    return seconds_from_env(WAIT_REPORT_ENV, DEFAULT_WAIT_REPORT, LaunchError)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class RendezvousWatch:
    """While this node waits at the rendezvous, say every ``interval`` which nodes have not come.

    Each node's watch marks it arrived in the job's store (node 0's agent hosts it) under
    keys of its own, one namespace per attempt, and reads which others have.
    """

    def __init__(self, node: NodeSpec, attempt: int, interval: float) -> None:
        self.node = node
        self.interval = interval
        self._prefix = f"loom/rendezvous/{attempt}/"
        self._store: dist.TCPStore | None = None
        self._done = threading.Event()
        self._reported = False
        self._thread = threading.Thread(target=self._watch, name="loom-rendezvous-watch", daemon=True)

    def __enter__(self) -> RendezvousWatch:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()  # not joined: a probe in flight may take seconds, and the thread checks _done before it speaks
        if self._reported and exc[0] is None:
            _say(f"loom: node {self.node.node_rank}: all {self.node.nnodes} nodes joined after {time.monotonic() - self._started:.0f}s")

    def _name(self, rank: int) -> str:
        host = f" ({self.node.hosts[rank]})" if rank < len(self.node.hosts) else ""
        return f"node {rank}{host}"

    def _check_in(self) -> list[int] | None:
        """The nodes not arrived yet, after marking this one; None while the store is unreachable."""
        try:
            if self._store is None:
                # A plain probe first: TCPStore logs a C++ error line for every failed connect.
                socket.create_connection((self.node.master_addr, self.node.master_port), timeout=min(self.interval, 5)).close()
                self._store = dist.TCPStore(
                    self.node.master_addr, self.node.master_port, is_master=False, wait_for_workers=False,
                    timeout=timedelta(seconds=min(self.interval, 5)),
                )  # fmt: skip
                self._store.set(f"{self._prefix}{self.node.node_rank}", "1")
            return [r for r in range(self.node.nnodes) if not self._store.check([f"{self._prefix}{r}"])]
        except (OSError, RuntimeError, dist.DistError):
            self._store = None
            return None

    def _watch(self) -> None:
        self._check_in()
        while not self._done.wait(self.interval):
            missing = self._check_in()
            if self._done.is_set():
                return
            if missing == []:
                continue  # every node is here; torch is still handing out ranks
            where = f"{self.node.master_addr}:{self.node.master_port}"
            if missing is None:
                names, why = self._name(0), f", whose rendezvous at {where} is not reachable yet"
            else:
                names, why = ", ".join(self._name(r) for r in missing), f" to join at {where}"
            waited = time.monotonic() - self._started
            _say(f"loom: node {self.node.node_rank} has waited {waited:.0f}s for {names}{why}")
            self._reported = True


class ReportingAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that reports a pending rendezvous and announces each restart."""

    def __init__(self, *args: Any, node: NodeSpec, world_size: int, wait_report: float, hung: dict[int, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._node = node
        self._world_size = world_size
        self._wait_report = wait_report
        self._hung = hung
        self._last_result: RunResult | None = None

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        if self._node.nnodes == 1:
            return super()._rendezvous(worker_group)
        attempt = worker_group.spec.max_restarts - self._remaining_restarts
        with RendezvousWatch(self._node, attempt, self._wait_report):
            super()._rendezvous(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._last_result = super()._monitor_workers(worker_group)
        self._hung.clear()
        if self._last_result.is_failed():
            self._share_failures(worker_group, self._last_result)
        return self._last_result

    def _share_failures(self, worker_group: WorkerGroup, result: RunResult) -> None:
        """Tell the ranks on other nodes which of this node's workers died, and how: their heartbeats
        read it (``HealthMonitor``), rather than wait for a silence. Not those this agent stopped.
        And read which of them the others named hung: this agent's kill of those is loom's, for the hang."""
        namespace = f"{PREFIX}/{worker_group.spec.max_restarts - self._remaining_restarts}"  # the workers' TORCHELASTIC_RESTART_COUNT
        try:
            store = dist.TCPStore(
                worker_group.master_addr, worker_group.master_port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5)
            )
            for rank, failure in result.failures.items():
                if failure.exitcode not in STOPPED:
                    how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exited with code {failure.exitcode}"
                    store.set(f"{namespace}/died/{rank}", how)
                if failure.exitcode == -signal.SIGKILL and store.check([f"{namespace}/hung/{rank}"]):
                    self._hung[rank] = store.get(f"{namespace}/hung/{rank}").decode()
        except (OSError, RuntimeError, dist.DistError):
            pass  # the store's node is gone too: the others see that themselves

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        # torch's agent has already counted this restart in _remaining_restarts.
        if self._last_result is not None and self._last_result.is_failed():
            limit = worker_group.spec.max_restarts
            headline = f"restart {limit - self._remaining_restarts} of {limit}"
            _say(report(self._last_result.failures, self._world_size, headline, self._hung))
        super()._restart_workers(worker_group)


def reporting_agent(node: NodeSpec, world_size: int, wait_report: float, hung: dict[int, str]) -> ContextManager[None]:
    """Have torchrun, called in this block, run its workers under a ``ReportingAgent``; it fills ``hung``
    with the workers of the last attempt it had to kill after the others named them hung, and how."""

    collective_log.arm_workers()  # before any worker's process group exists, whatever its backend
    if FAULT_DUMP_ENV not in os.environ:  # a worker ended by a signal leaves its stacks there, for ``failures``
        os.environ[FAULT_DUMP_ENV] = tempfile.mkdtemp(prefix="loom-faults-")
        atexit.register(shutil.rmtree, os.environ[FAULT_DUMP_ENV], ignore_errors=True)

    def build(**kwargs: Any) -> ReportingAgent:
        return ReportingAgent(node=node, world_size=world_size, wait_report=wait_report, hung=hung, **kwargs)

    return elastic_agent(build)
