"""The health monitor's load on the job's store, and its alarm, with many simulated ranks in one process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import pytest
import torch.distributed as dist

from loom.cluster import ClusterSpec
from loom.comm import ring
from loom.comm.health import PREFIX, HealthMonitor

NAMESPACE = f"{PREFIX}/0"  # the first attempt's


class CountingStore:
    """A store client that counts the requests it sends, per simulated rank."""

    def __init__(self, store: dist.TCPStore, counts: list[int], rank: int, lock: threading.Lock) -> None:
        self._store, self._counts, self._rank, self._lock = store, counts, rank, lock

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._store, name)

        def request(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._counts[self._rank] += 1
            return method(*args, **kwargs)

        return request


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the simulated ranks did not get there in time"
        time.sleep(0.01)


@pytest.fixture
def left(monkeypatch) -> list[str]:
    """The lines of simulated ranks that gave up: a rank leaves by ending its thread, not (as a real
    rank does, by ``os._exit``) the test's process, which is every rank's."""
    lines: list[str] = []

    def leave(self: HealthMonitor, line: str | None, code: int) -> None:
        lines.append(line or f"rank {self.spec.rank} left with code {code}")
        raise SystemExit  # ends this monitor's thread only

    monkeypatch.setattr(HealthMonitor, "_leave", leave)
    return lines


@pytest.fixture
def job(monkeypatch, left):
    """``job(world)``: a context in which ``world`` simulated ranks (monitors beating every 50 ms)
    share one store; yields the store and each rank's count of requests."""
    monkeypatch.setenv("LOOM_HANG_CHECK", "3600")  # the ranks share one main thread, which waits in the test
    # and one interpreter: beside other jobs' CPU, a rank's beats can pause for long; these tests count requests
    # and name dead processes, not silence
    monkeypatch.setenv("LOOM_HEARTBEAT_TIMEOUT", "3600")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    connect = HealthMonitor._connect

    @contextlib.contextmanager
    def simulate(world: int, skip: tuple[int, ...] = ()) -> Iterator[tuple[dist.TCPStore, list[int]]]:
        master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        counts, lock = [0] * world, threading.Lock()
        monkeypatch.setattr(HealthMonitor, "_connect", lambda self: CountingStore(connect(self), counts, self.spec.rank, lock))
        monitors = [HealthMonitor(ClusterSpec(r, world, r, world, 0, "127.0.0.1", master.port), interval=0.05) for r in range(world) if r not in skip]
        try:
            for monitor in monitors:
                monitor.watch()
            yield master, counts
        finally:
            for monitor in monitors:
                monitor.stop()

    return simulate


def beats(store: dist.TCPStore, world: int) -> list[int]:
    return [store.add(f"{NAMESPACE}/beat/{r}", 0) for r in range(world)]


def requests_per_beat(job: Callable, world: int) -> float:
    """Store requests per rank per heartbeat, once every rank has joined and watches."""
    with job(world) as (store, counts):
        wait_until(lambda: min(beats(store, world)) >= 3)
        sent, beaten = sum(counts), sum(beats(store, world))
        wait_until(lambda: min(beats(store, world)) >= 3 + 10)
        return (sum(counts) - sent) / (sum(beats(store, world)) - beaten)


def test_each_ranks_store_load_does_not_grow_with_the_job(job, left):
    # Every rank used to read every other rank's heartbeat: about 3N requests per rank per beat.
    small, large = requests_per_beat(job, 4), requests_per_beat(job, 16)
    assert large <= 1.2 * small, f"{small:.1f} requests per rank per beat at 4 ranks, {large:.1f} at 16"
    assert not left, left


def test_every_rank_names_a_dead_rank_that_only_its_watchers_see(job, monkeypatch):
    said: dict[int, str] = {}

    def leave(self: HealthMonitor, line: str | None, code: int) -> None:
        said[self.spec.rank] = line  # and carry on: the test's process is every rank's

    monkeypatch.setattr(HealthMonitor, "_leave", leave)
    dead = subprocess.Popen(["true"])
    dead.wait()
    with job(6, skip=(3,)) as (store, _):
        store.set(f"{NAMESPACE}/member/3", json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
        wait_until(lambda: len(said) == 5)
    reason = f"rank 3 ({socket.gethostname()}, pid {dead.pid}) died"
    assert said == {r: f"loom: rank {r} on {socket.gethostname()} cannot continue: {reason}" for r in (0, 1, 2, 4, 5)}


def test_a_finished_rank_hands_its_watch_on():
    store = dist.HashStore()
    assert ring.watched(store, "p", 0, 6, set()) == [1, 2]
    assert ring.watched(store, "p", 5, 6, set()) == [0, 1]
    store.set("p/done/1", "1")
    store.set("p/done/2", "1")
    finished: set[int] = set()
    assert ring.watched(store, "p", 0, 6, finished) == [3, 4] and finished == {1, 2}
    assert ring.watched(store, "p", 5, 6, set()) == [0, 3]
    assert ring.watched(store, "q", 0, 2, set()) == [1]
    for r in range(1, 6):
        store.set(f"p/done/{r}", "1")
    assert ring.watched(store, "p", 0, 6, set()) == []


def test_a_heartbeat_whose_connect_times_out_connects_again(job, monkeypatch):
    """The store's connect can time out on a busy machine: the rank's beats must go on, or its watchers name it silent."""
    connect, failed = HealthMonitor._connect, []

    def slow_once(self: HealthMonitor) -> dist.TCPStore:
        if threading.current_thread().name == "loom-heartbeat" and not failed:
            failed.append(self.spec.rank)
            raise dist.DistStoreError("wait timeout after 10000ms")
        return connect(self)

    monkeypatch.setattr(HealthMonitor, "_connect", slow_once)
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monitor = HealthMonitor(ClusterSpec(0, 1, 0, 1, 0, "127.0.0.1", master.port), interval=0.05)
    monitor.watch()
    try:
        wait_until(lambda: beats(master, 1) >= [3])
    finally:
        monitor.stop()
    assert failed == [0]


STOPPED_RANK = """
import sys, time
import torch.distributed as dist
from loom.cluster import ClusterSpec
from loom.comm.health import HealthMonitor
master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
monitors = [HealthMonitor(ClusterSpec(r, 2, r, 2, 0, "127.0.0.1", master.port), interval=0.05) for r in range(2)]
for monitor in monitors:
    monitor._leave = lambda line, code: (print(line, flush=True), sys.exit(3))
    monitor.watch()
print("watching", flush=True)
time.sleep(3600)
"""


def test_a_rank_stopped_longer_than_the_heartbeat_timeout_and_resumed_accuses_nobody(tmp_path):
    """A stopped process (SIGSTOP, a paused VM, a starved machine) comes back to a clock that jumped: the
    silence is its own, not its store's nor its peers'. Its peers would name it; it must not name them."""
    # a timeout a busy machine's scheduling cannot reach (its beats come every 50 ms), and a stop of twice that
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_RANK], env={**os.environ, "LOOM_HEARTBEAT_TIMEOUT": "4", "LOOM_HANG_CHECK": "3600"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline() == "watching\n"
        proc.send_signal(signal.SIGSTOP)
        time.sleep(8)  # the stop itself is the condition
        proc.send_signal(signal.SIGCONT)
        with pytest.raises(subprocess.TimeoutExpired):  # still running: its beats resumed, nobody was named
            proc.wait(timeout=5)
    finally:
        proc.kill()
    said = proc.communicate()[0]
    assert "lost contact" not in said and "cannot continue" not in said, said
