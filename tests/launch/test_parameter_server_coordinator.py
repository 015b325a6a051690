"""``ClusterCoordinator`` on a ``loom run --ps`` job: the chief schedules, the workers run the steps,
and a step whose worker is killed runs again elsewhere with its update applied exactly once.

One job (one server, the chief and two workers, one restart each) goes through both deaths:
worker 2 is killed (kill -9) after its step's update was applied but before it gave the
result, and its successor is killed in its first step (that same step, given back to it)
before its push; that step then runs on worker 1, whose push the servers ignore.
"""

import json
import subprocess
import time

import pytest

from tests.helpers import LOOM, ROOT, SCRIPTS, job_env, popen

STEPS = 8


def _kill_when_stopped(job, marker, deadline):
    """``kill -9`` of the worker that wrote ``marker`` (``<pid> <step>``), once it exists; its step."""
    while not marker.exists():
        assert job.poll() is None, f"the job ended before {marker.name}: {job.communicate(timeout=5)}"
        assert time.monotonic() < deadline, f"no {marker.name} in time"
        time.sleep(0.02)
    pid, step = map(int, marker.read_text().split())
    subprocess.run(["kill", "-9", str(pid)], check=True)
    return step


@pytest.fixture(scope="module")
def coordinated_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("coordinator") / "out"
    job = popen(
        [*LOOM, "run", "--ps", "1", "--workers", "3", "--max-restarts", "1", "--threads", "1",
         str(SCRIPTS / "ps_coordinated.py"), str(out), str(STEPS)],
        cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 150
    try:
        after = _kill_when_stopped(job, out.with_name("out.after"), deadline)
        before = _kill_when_stopped(job, out.with_name("out.before"), deadline)
        stdout, stderr = job.communicate(timeout=max(deadline - time.monotonic(), 10))
    finally:
        job.kill()
    report = json.loads(out.with_name("out.json").read_text()) if out.with_name("out.json").exists() else None
    return job.returncode, stderr, report, after, before


@pytest.mark.timeout(240)
def test_every_scheduled_step_is_applied_exactly_once_though_its_worker_was_killed_twice(coordinated_job):
    code, stderr, report, after, before = coordinated_job
    assert report is not None, stderr[-3000:]
    assert report["servers"] == STEPS and report["chief_model"] == STEPS  # each step's +1 once: none lost, none twice
    assert report["done"] and [r["step"] for r in report["results"]] == list(range(STEPS))
    # the successor was given the step its predecessor died in (update applied, result not given), and died in it
    # too; worker 1 ran it then (its push ignored, as the counter shows) and gave the result
    assert before == after
    assert [r["worker"] for r in report["results"]].count(2) == 1 and report["results"][after]["worker"] == 1
    assert "worker 2" in stderr and "restarting it (1 of 1)" in stderr
    assert code == 1 and "job finished with failures: worker 2 exited with code -9; the other workers completed" in stderr, stderr[-3000:]
