"""``loom run --ps N --workers M``: servers and independent workers; a killed worker or server is restarted alone.

Asynchronous workers go on without a dead worker; synchronous ones wait for its successor.
The asynchronous tests share one job (TLS on, ``--threads`` given) that goes through every
failure in turn: worker 1 kills itself between its two commits, the test kills worker 2, and,
while every worker is held before a later step, it kills server 1, then lets the workers go on.
"""

import json
import subprocess
import time
from dataclasses import dataclass

import pytest

from loom.devices import thread_budget
from tests.helpers import LOOM, ROOT, SCRIPTS, job_env, popen, read_progress
from tests.strategies.parameter_server.test_transport import self_signed

STEPS, DIE_AT, KILL_AT, HOLD_AT = 30, 8, 10, 20  # worker 1 dies in step 8's push; worker 2 is killed at step 10


def _job(out, steps, *flags, die_at=0, hold_at=None):
    hold = [str(hold_at)] if hold_at else []
    return popen(
        [*LOOM, "run", *flags, str(SCRIPTS / "ps_train.py"), str(out), str(steps), *([str(die_at)] if die_at or hold else []), *hold],
        cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _wait_for(job, ready, what, deadline):
    while not ready():
        assert job.poll() is None, f"the job ended before {what}: {job.communicate(timeout=5)}"
        assert time.monotonic() < deadline, f"no {what} in time"
        time.sleep(0.02)


def _kill_worker_at(job, out, worker, step, deadline):
    """``kill -9`` of ``worker``'s process once it has done ``step`` steps; its pid."""
    _wait_for(job, lambda: [p for w, p, s in read_progress(out) if w == worker and s >= step], f"worker {worker} at step {step}", deadline)
    victim = next(p for w, p, s in read_progress(out) if w == worker)
    subprocess.run(["kill", "-9", str(victim)], check=True)
    return victim


def _pids(out, suffix):
    """worker -> its processes' pids, in the order they wrote a line to ``OUT.<suffix>``."""
    path = out.with_name(f"{out.name}.{suffix}")
    pids: dict[int, list[int]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        worker, pid = map(int, line.split()[:2])
        pids.setdefault(worker, []).append(pid)
    return pids


def _all_held_after_restarts(out):
    """Every worker waits at the hold, workers 1 and 2 as their second processes."""
    started, held = _pids(out, "threads"), _pids(out, "held")
    return held.keys() == {0, 1, 2} and all(len(started[w]) == 2 and started[w][1] in held[w] for w in (1, 2))


def _server_pid(index, state_dir):
    """The pid of this job's server ``index`` (its checkpoint file is in ``state_dir``)."""
    listing = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        if "parameter_server.serve" in line and str(state_dir / f"server-{index}.safetensors") in line:
            return int(line.split()[0])
    raise AssertionError(f"no server {index} of this job running:\n{listing}")


def shared(test):
    """A test of the shared asynchronous job: in its process group; the first to run waits for the whole job."""
    return pytest.mark.timeout(300)(pytest.mark.xdist_group("ps_async_job")(test))


@dataclass
class AsyncJob:
    code: int
    stdout: str
    stderr: str
    progress: list[tuple[int, int, int]]
    servers: list[dict]  # each server's stats at the end
    died: int  # worker 1's first process, killed by itself mid-push
    killed: int  # worker 2's first process, killed by the test
    others_at_kill: dict[int, int]  # workers 0 and 1: their steps when worker 2 was killed
    server_killed: int  # server 1's first process
    threads: int  # --threads
    seen_threads: list[list[str]]  # each worker process: worker, pid, OMP_NUM_THREADS, LOOM_THREADS, torch's threads


@pytest.fixture(scope="session")
def async_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ps-async")
    cert, key = self_signed(tmp, "job")
    out, state = tmp / "out", tmp / "ps"
    threads = thread_budget(3) + 1  # not the default, so that the flag shows
    flags = ["--ps", "2", "--workers", "3", "--max-restarts", "1", "--threads", str(threads), "--ps-checkpoint-dir", str(state),
             "--ps-tls-cert", str(cert), "--ps-tls-key", str(key)]  # fmt: skip
    job = _job(out, STEPS, *flags, die_at=DIE_AT, hold_at=HOLD_AT)
    deadline = time.monotonic() + 200  # for the job to reach the server kill, even on a busy machine
    try:
        killed = _kill_worker_at(job, out, worker=2, step=KILL_AT, deadline=deadline)
        others = {w: max((s for v, _, s in read_progress(out) if v == w), default=0) for w in (0, 1)}
        # the successors of workers 1 and 2 start once their launcher has settled their predecessors' last pushes
        _wait_for(job, lambda: _all_held_after_restarts(out), "every worker held, workers 1 and 2 restarted", deadline)
        checkpoint = state / "server-1.safetensors"
        saved = checkpoint.stat().st_mtime_ns
        _wait_for(job, lambda: checkpoint.stat().st_mtime_ns != saved, "a checkpoint of server 1 with every worker held", deadline)
        server = _server_pid(1, state)
        subprocess.run(["kill", "-9", str(server)], check=True)
        out.with_name("out.go").touch()  # the workers' next pushes meet a dead server 1, then its successor
        stdout, stderr = job.communicate(timeout=90)
    finally:
        job.kill()
    stats = out.with_name("out.stats")
    servers = json.loads(stats.read_text()) if stats.exists() else []
    seen = [line.split() for line in out.with_name("out.threads").read_text().splitlines()]
    died = _pids(out, "threads")[1][0]
    return AsyncJob(job.returncode, stdout, stderr, read_progress(out), servers, died, killed, others, server, threads, seen)


@shared
def test_a_killed_worker_is_restarted_while_the_others_go_on_and_no_update_counts_twice(async_job):
    job, steps = async_job, async_job.progress
    assert job.code == 0, job.stderr[-3000:]
    assert f"worker 2 (pid {job.killed}) exited with code -9; restarting it (1 of 1), the others go on" in job.stderr
    assert len({p for w, p, _ in steps if w == 0}) == 1 and max(s for w, _, s in steps if w == 0) == STEPS  # never restarted
    assert all(job.others_at_kill[w] < STEPS for w in (0, 1)), job.others_at_kill  # they went on after it
    for worker, victim in ((1, job.died), (2, job.killed)):
        incarnations = {p: max(s for _, q, s in steps if q == p) for w, p, _ in steps if w == worker}
        assert len(incarnations) == 2 and incarnations[victim] < STEPS and max(incarnations.values()) == STEPS
        successor = next(p for p in incarnations if p != victim)  # goes on from its predecessor's steps
        assert min(s for _, p, s in steps if p == successor) in (incarnations[victim] + 1, incarnations[victim] + 2)
    assert len(job.servers) == 2
    for stats in job.servers:  # every server, the restarted one too: each push of each worker process applied once
        assert {int(name.rsplit(".", 1)[1]) for name in stats["applied"]} == {p for _, p, _ in steps}, stats
        for name, count in stats["applied"].items():
            pid = int(name.rsplit(".", 1)[1])
            done = len([s for _, p, s in steps if p == pid])
            assert count in (done, done + 1) if pid == job.killed else count == done + (pid == job.died), (name, count, done)
    assert len({stats["applied"][f"worker-2.{job.killed}"] for stats in job.servers}) == 1  # none half-applied: same count everywhere


@shared
def test_a_worker_killed_between_its_commits_has_that_push_applied_on_every_server(async_job):
    job = async_job
    assert job.code == 0, job.stderr[-3000:]
    assert max(s for _, p, s in job.progress if p == job.died) == DIE_AT - 1  # died in step 8's push
    assert f"worker 1 (pid {job.died}) exited with code -9; restarting it" in job.stderr  # killed between its commits
    assert f"loom: worker 1 died mid-push: push {DIE_AT - 1} of worker-1.{job.died} applied on every server (127.0.0.1:" in job.stderr
    for stats in job.servers:
        assert stats["applied"][f"worker-1.{job.died}"] == DIE_AT  # steps 1-7, and step 8's push, on both servers


@shared
def test_a_killed_server_is_restarted_from_its_checkpoint_and_the_workers_go_on(async_job):
    job = async_job
    assert job.code == 0, job.stderr[-3000:]
    assert "parameter server 1 (127.0.0.1:" in job.stderr
    assert f"pid {job.server_killed}) exited with code -9; restarting it from its checkpoint" in job.stderr
    assert "parameter server 1 listening on 127.0.0.1:" in job.stdout and "(resumed from" in job.stdout
    assert {w: max(s for v, _, s in job.progress if v == w) for w in (0, 1, 2)} == {0: STEPS, 1: STEPS, 2: STEPS}
    for stats in job.servers:  # server 1 resumed at its last save (every worker was held): none lost, none twice
        assert stats["version"] == sum(stats["applied"].values()) == job.servers[0]["version"], stats


@shared
def test_a_job_with_tls_trains_and_its_servers_exit_when_the_workers_are_done(async_job):
    job = async_job
    assert job.code == 0, job.stderr[-3000:]
    assert job.stdout.count("listening on") == job.stdout.count("with TLS") == 3  # two servers, and server 1's successor
    assert job.stdout.count("every worker has finished; exiting") == 2


@shared
def test_threads_sets_every_workers_thread_count(async_job):
    job = async_job
    assert len(job.seen_threads) == 5  # three workers, two of them restarted
    assert all(seen[2:] == [str(job.threads)] * 3 for seen in job.seen_threads), job.seen_threads


def test_synchronous_workers_wait_for_a_killed_ones_successor_and_every_round_applies_once(tmp_path):
    out, steps = tmp_path / "out", 40
    job = _job(out, steps, "--ps", "2", "--workers", "2", "--sync", "--max-restarts", "1")
    try:
        victim = _kill_worker_at(job, out, worker=1, step=10, deadline=time.monotonic() + 90)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    progress = read_progress(out)
    killed_at = max(s for _, p, s in progress if p == victim)
    successor = {p: [s for _, q, s in progress if q == p] for w, p, _ in progress if w == 1 and p != victim}
    assert len(successor) == 1 and max(next(iter(successor.values()))) == steps
    assert min(next(iter(successor.values()))) in (killed_at + 1, killed_at + 2)  # resumed at the job's round
    assert [s for w, _, s in progress if w == 0] == list(range(1, steps + 1))
    for server in json.loads(out.with_name("out.stats").read_text()):
        assert server["version"] == server["round"] + 1 == steps  # every round applied once, none lost


def test_threads_below_one_is_refused_in_one_line(capsys):
    from loom.launch.cli import main

    assert main(["run", "--ps", "1", "--workers", "1", "--threads", "0", "x.py"]) == 2
    assert capsys.readouterr().err == "loom: error: --threads must be at least 1 (got 0); leave it out for cores / workers\n"
