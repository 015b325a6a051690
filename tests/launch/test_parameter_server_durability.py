"""A parameter server killed with ``kill -9`` comes back with every update a worker saw acknowledged.

Two synchronous jobs train side by side on the same data: one uninterrupted, one whose server 1
is killed mid-run (``--max-restarts 1``) while its log holds rounds its last snapshot does not.
They end with the same variables and optimizer slots, bit for bit: with two workers a round's
sum is the same whichever share came first, and the restarted server replays the same rounds in
the same order. A third job loses server 1's state files with the server: it fails, naming the
server and how many updates it lost.
"""

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass

import pytest
import torch
from safetensors import safe_open

from tests.helpers import LOOM, ROOT, SCRIPTS, job_env, popen, read_progress

STEPS, HOLD_AT = 40, 6
pytestmark = pytest.mark.timeout(300)
shared = pytest.mark.xdist_group("ps_kill_pair")  # the tests of the two jobs run on one xdist worker: the jobs run once


def _job(out, *flags, hold_at=None):
    command = [*LOOM, "run", "--ps", "2", "--workers", "2", "--sync", *flags, str(SCRIPTS / "ps_sync_final.py"), str(out), str(STEPS)]
    return popen([*command, *([str(hold_at)] if hold_at else [])], cwd=ROOT, env=job_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_for(job, ready, what, deadline):
    while not ready():
        assert job.poll() is None, f"the job ended before {what}: {job.communicate(timeout=5)}"
        assert time.monotonic() < deadline, f"no {what} in time"
        time.sleep(0.02)


def _server_pid(index, state):
    """The pid of the job's server ``index`` (its state file is in ``state``)."""
    listing = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        if "parameter_server.serve" in line and str(state / f"server-{index}.safetensors") in line:
            return int(line.split()[0])
    raise AssertionError(f"no server {index} of this job running:\n{listing}")


def _rounds_done(out):
    """Rounds every worker has finished (each worker's last step, the smaller)."""
    last = {}
    for worker, _, step in read_progress(out):
        last[worker] = max(last.get(worker, 0), step)
    return min(last.values()) if len(last) == 2 else 0


def _snapshot_rounds(path):
    """Rounds applied in server ``path``'s last snapshot (0 without one)."""
    if not path.exists():
        return 0
    with safe_open(str(path), framework="pt") as file:
        return json.loads(file.metadata()["loom"])["round"] + 1


def _stop_past_snapshot(job, out, state, deadline):
    """SIGSTOP server 1 once the workers are at least two rounds past its last snapshot, so that
    only its log holds those; its pid and the rounds done. (Stopped, it can neither snapshot nor
    apply a round.) The workers are held before round ``HOLD_AT`` until server 1 has a snapshot."""
    held, snapshot = out.with_name(f"{out.name}.held"), state / "server-1.safetensors"
    _wait_for(job, lambda: held.exists() and len(held.read_text().splitlines()) == 2, "both workers held", deadline)
    pid = _server_pid(1, state)
    _wait_for(job, lambda: _snapshot_rounds(snapshot) == HOLD_AT - 1, "a snapshot of server 1 with both workers held", deadline)
    out.with_name(f"{out.name}.go").touch()
    target = HOLD_AT + 2
    while True:
        _wait_for(job, lambda: _rounds_done(out) >= target, f"round {target}", deadline)
        os.kill(pid, signal.SIGSTOP)
        done = _rounds_done(out)
        if done - _snapshot_rounds(snapshot) >= 2:
            return pid, done
        os.kill(pid, signal.SIGCONT)  # it had just snapshotted: let two more rounds into its log
        target = done + 2
        assert target < STEPS, "server 1 snapshotted too often to be killed between its snapshots"


@dataclass
class Pair:
    reference: dict
    killed: dict
    code: int
    stdout: str
    stderr: str
    pid: int
    rounds_at_kill: int


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ps-kill")
    reference, out, state = tmp / "reference", tmp / "out", tmp / "ps"
    jobs = [_job(reference), _job(out, "--max-restarts", "1", "--ps-checkpoint-dir", str(state), hold_at=HOLD_AT)]
    try:
        pid, rounds = _stop_past_snapshot(jobs[1], out, state, time.monotonic() + 150)
        os.kill(pid, signal.SIGKILL)
        done = [job.communicate(timeout=150) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    assert jobs[0].returncode == 0, done[0][1][-3000:]
    final = {name: torch.load(f"{path}.final") if os.path.exists(f"{path}.final") else {} for name, path in (("reference", reference), ("killed", out))}
    return Pair(final["reference"], final["killed"], jobs[1].returncode, *done[1], pid, rounds)


@shared
def test_a_server_killed_mid_run_comes_back_from_its_log_and_the_job_goes_on(pair):
    assert pair.code == 0, pair.stderr[-3000:]
    assert f"pid {pair.pid}) exited with code -9; restarting it from its checkpoint (1 of 1)" in pair.stderr
    resumed = re.search(r"parameter server 1 listening on \S+ \(resumed from \S+: (\d+) updates: (\d+) from its snapshot, (\d+) from its log\)", pair.stdout)
    assert resumed, pair.stdout
    total, from_snapshot, from_log = map(int, resumed.groups())
    assert total == from_snapshot + from_log >= pair.rounds_at_kill  # every round applied before the kill
    assert from_snapshot >= HOLD_AT - 1 and from_log >= 2  # the snapshot taken while the workers were held, then the log


@shared
def test_a_synchronous_job_whose_server_was_killed_ends_with_the_uninterrupted_runs_variables(pair):
    assert pair.code == 0, pair.stderr[-3000:]
    assert pair.killed.keys() == pair.reference.keys() and "bag" in pair.killed
    for name, (value, slots) in pair.reference.items():
        assert torch.equal(pair.killed[name][0], value), name
        assert slots.keys() == pair.killed[name][1].keys(), name
        for slot, expected in slots.items():
            got = pair.killed[name][1][slot]
            assert torch.equal(got, expected) if isinstance(expected, torch.Tensor) else got == expected, (name, slot)
    assert pair.reference["bag"][1]["step"] == STEPS  # every round applied once


def test_a_server_that_lost_its_state_files_fails_the_job_naming_how_many_updates_it_lost(tmp_path):
    out, state = tmp_path / "out", tmp_path / "ps"
    job = _job(out, "--max-restarts", "1", "--ps-checkpoint-dir", str(state), hold_at=HOLD_AT)
    held = out.with_name("out.held")
    try:
        _wait_for(job, lambda: held.exists() and len(held.read_text().splitlines()) == 2, "both workers held", time.monotonic() + 150)
        pid = _server_pid(1, state)
        os.kill(pid, signal.SIGSTOP)  # frozen: it writes nothing more
        for path in state.glob("server-1.safetensors*"):
            path.unlink()
        os.kill(pid, signal.SIGKILL)
        out.with_name("out.go").touch()
        _, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 1, stderr[-3000:]
    seen = HOLD_AT - 1  # every worker saw round HOLD_AT - 1 applied before it held
    lost = (rf"loom: job failed: parameter server 1 \(127\.0\.0\.1:\d+, pid \d+\) lost {seen} updates that workers saw applied: "
            rf"it came back at update 0, a worker had seen update {seen} \(its state files were removed or damaged\); they cannot be "
            r"recovered, so the job stops: start it again from its last checkpoint\n")  # fmt: skip
    assert re.search(lost, stderr), stderr[-3000:]
    assert not out.with_name("out.final").exists()
