"""One chief per job, and the job's first line: replicas and model-parallel degrees, then processes."""

import subprocess

import pytest

from tests.helpers import LOOM, ROOT, SCRIPTS, job_env


@pytest.mark.parametrize(
    "kind, first",
    [
        ("tensor", "loom: 1 replica x 2 tensor-parallel ranks = 1 node x 2 processes (--nproc 2)"),
        ("pipeline", "loom: 1 replica x 2 pipeline stages = 1 node x 2 processes (--nproc 2)"),
    ],
)
def test_one_chief_and_the_first_line_counts_replicas(kind, first):
    done = subprocess.run([*LOOM, "run", "--nproc", "2", str(SCRIPTS / "chief_job.py"), kind],
                          cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.splitlines()[0] == first, done.stderr[-3000:]
    assert done.stderr.count("loom: ") == 1
    lines = done.stdout.splitlines()
    assert sorted(lines) == ["is_chief=False", "is_chief=True", "printed once"], lines
