"""Training that survives: kill -9 with restarts, and SIGTERM as a preemption notice."""

import random
import signal
import subprocess
import time

import pytest
import torch

from loom.checkpoint import committed
from tests.helpers import LOOM, ROOT, SCRIPTS, job_env, popen, read_progress

pytestmark = [
    pytest.mark.xdist_group("fault_tolerance"),  # its tests share one launched job: one test process runs them all
    pytest.mark.timeout(420),  # the first runs the two reference jobs too; each wait below is bounded on its own
]

SCRIPT = str(SCRIPTS / "fit_resumable.py")


def _start(out, checkpoints, kind, *flags):
    return popen(
        [*LOOM, "run", "--nproc", "2", "--timeout", "30", *flags, SCRIPT, str(out), str(checkpoints), kind],
        cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _finish(proc, timeout=120):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out, err


def _wait_for_step(out, step, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        seen = read_progress(out)
        if seen and seen[-1][2] >= step:
            return seen[-1]
        assert proc.poll() is None, f"the job ended before step {step}: {_finish(proc)}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.01)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Final parameters of uninterrupted runs, one per kind of input."""
    finals = {}
    for kind in ("dataset", "pipeline"):
        tmp = tmp_path_factory.mktemp(kind)
        code, _, err = _finish(_start(tmp / "out", tmp / "ckpt", kind))
        assert code == 0, err[-2000:]
        finals[kind] = torch.load(tmp / "out.pt")
    return finals


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_kill_9_at_a_random_step_restarts_and_ends_with_the_same_parameters(tmp_path, reference):
    out, checkpoints = tmp_path / "out", tmp_path / "ckpt"
    proc = _start(out, checkpoints, "pipeline", "--max-restarts", "1")
    kill_at = random.randint(3, 25)  # of 30 steps
    _, pid, _ = _wait_for_step(out, kill_at, proc)
    subprocess.run(["kill", "-9", str(pid)], check=True)
    code, _, err = _finish(proc)
    assert code == 0, err[-3000:]
    attempts = read_progress(out)
    resumed = [step for attempt, _, step in attempts if attempt == 1]
    assert resumed and resumed[0] > 1, f"the restarted job did not resume (killed at step {kill_at}): {resumed[:3]}"
    assert _same(torch.load(out.with_suffix(".pt")), reference["pipeline"]), f"killed at step {kill_at}"


def test_sigterm_saves_after_the_step_exits_0_and_the_next_run_resumes(tmp_path, reference):
    out, checkpoints = tmp_path / "out", tmp_path / "ckpt"
    proc = _start(out, checkpoints, "dataset")
    _wait_for_step(out, 5, proc)
    proc.send_signal(signal.SIGTERM)  # to the launcher, as a scheduler does; it passes it on
    code, stdout, stderr = _finish(proc)
    assert "loom: preempted: saved step" in stdout, stderr[-3000:]
    saved_step = int(stdout.split("loom: preempted: saved step ")[1].split()[0])
    assert committed(checkpoints)[-1].name == f"step-{saved_step:08d}"
    code, stdout, stderr = _finish(_start(out, checkpoints, "dataset"))
    assert code == 0, stderr[-3000:]
    assert f"resumed from {checkpoints}/step-{saved_step:08d}" in stdout
    assert _same(torch.load(out.with_suffix(".pt")), reference["dataset"])
