"""``loom run --ps N --workers M``: servers and independent workers; a killed worker is restarted alone.

Asynchronous workers go on without it; synchronous ones wait for its successor.
"""

import json
import subprocess
import time

from tests.helpers import LOOM, ROOT, SCRIPTS, job_env, read_progress


def _job(out, steps, *flags, die_at=None):
    return subprocess.Popen(
        [*LOOM, "run", *flags, str(SCRIPTS / "ps_train.py"), str(out), str(steps), *([str(die_at)] if die_at else [])],
        cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _kill_worker_at(job, out, worker, step):
    """``kill -9`` of ``worker``'s process once it has done ``step`` steps; its pid."""
    deadline = time.monotonic() + 90
    while not [p for w, p, s in read_progress(out) if w == worker and s >= step]:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=5)
        time.sleep(0.02)
    victim = next(p for w, p, s in read_progress(out) if w == worker)
    subprocess.run(["kill", "-9", str(victim)], check=True)
    return victim


def test_a_killed_worker_is_restarted_while_the_others_go_on_and_no_update_counts_twice(tmp_path):
    out = tmp_path / "out"
    job = _job(out, 60, "--ps", "2", "--workers", "3", "--max-restarts", "1")
    try:
        victim = _kill_worker_at(job, out, worker=1, step=10)
        others_before = {w: s for w, _, s in read_progress(out) if w != 1}
        stdout, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert f"worker 1 (pid {victim}) exited with code -9; restarting it (1 of 1), the others go on" in stderr
    steps = read_progress(out)
    for worker in (0, 2):  # never restarted: one process each, all steps
        assert {p for w, p, _ in steps if w == worker} and len({p for w, p, _ in steps if w == worker}) == 1
        assert max(s for w, _, s in steps if w == worker) == 60 and others_before[worker] < 60
    incarnations = {p: max(s for w, q, s in steps if q == p) for w, p, _ in steps if w == 1}
    assert len(incarnations) == 2 and incarnations[victim] < 60 and max(incarnations.values()) == 60
    successor = next(p for p in incarnations if p != victim)  # goes on from its predecessor's steps
    assert min(s for _, p, s in steps if p == successor) in (incarnations[victim] + 1, incarnations[victim] + 2)
    servers = json.loads(out.with_name("out.stats").read_text())
    for stats in servers:  # every server: each push of each worker process applied once
        for name, count in stats["applied"].items():
            pid = int(name.rsplit(".", 1)[1])
            done = len([s for _, p, s in steps if p == pid])
            assert count in (done, done + 1) if pid == victim else count == done, (name, count, done)
    assert len({stats["applied"][f"worker-1.{victim}"] for stats in servers}) == 1  # none half-applied: same count everywhere


def test_a_worker_killed_between_its_commits_has_that_push_applied_on_every_server(tmp_path):
    out = tmp_path / "out"
    job = _job(out, 20, "--ps", "2", "--workers", "2", "--max-restarts", "1", die_at=8)
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 0, stderr[-3000:]
    progress = read_progress(out)
    victim = next(p for w, p, _ in progress if w == 1)
    assert max(s for _, p, s in progress if p == victim) == 7  # died in step 8's push
    assert f"loom: worker 1 died mid-push: push 7 of worker-1.{victim} applied on every server (127.0.0.1:" in stderr
    for stats in json.loads(out.with_name("out.stats").read_text()):
        assert stats["applied"][f"worker-1.{victim}"] == 8  # steps 1-7, and step 8's push, on both servers


def test_synchronous_workers_wait_for_a_killed_ones_successor_and_every_round_applies_once(tmp_path):
    out, steps = tmp_path / "out", 40
    job = _job(out, steps, "--ps", "2", "--workers", "2", "--sync", "--max-restarts", "1")
    try:
        victim = _kill_worker_at(job, out, worker=1, step=10)
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


def _server_pid(index, state_dir):
    """The pid of this job's server ``index`` (its checkpoint file is in ``state_dir``)."""
    listing = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        if "parameter_server.serve" in line and str(state_dir / f"server-{index}.safetensors") in line:
            return int(line.split()[0])
    raise AssertionError(f"no server {index} of this job running:\n{listing}")


def test_a_killed_server_is_restarted_from_its_checkpoint_and_the_workers_go_on(tmp_path):
    out = tmp_path / "out"
    job = subprocess.Popen(
        [*LOOM, "run", "--ps", "2", "--workers", "2", "--max-restarts", "1", "--ps-checkpoint-dir", str(tmp_path / "ps"),
         str(SCRIPTS / "ps_train.py"), str(out), "150"],
        cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "ps" / "server-1.safetensors").exists() or len(read_progress(out)) < 60:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=5)
            time.sleep(0.05)
        victim = _server_pid(1, tmp_path / "ps")
        subprocess.run(["kill", "-9", str(victim)], check=True)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert "parameter server 1 (127.0.0.1:" in stderr and f"pid {victim}) exited with code -9; restarting it from its checkpoint" in stderr
    assert "parameter server 1 listening on 127.0.0.1:" in stdout and "(resumed from" in stdout
    steps = read_progress(out)
    assert {w: max(s for v, _, s in steps if v == w) for w in (0, 1)} == {0: 150, 1: 150}
    stats = json.loads(out.with_name("out.stats").read_text())
    assert sum(stats[0]["applied"].values()) == 300  # the server that never died applied every push once
