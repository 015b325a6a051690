"""One chief per job, and the job's first line: replicas and model-parallel degrees, then processes."""

import pytest

from tests.helpers import SCRIPTS, loom_run


@pytest.mark.parametrize(
    "kind, first",
    [
        ("tensor", "loom: 1 replica x 2 tensor-parallel ranks = 1 node x 2 processes (--nproc 2)"),
        ("pipeline", "loom: 1 replica x 2 pipeline stages = 1 node x 2 processes (--nproc 2)"),
    ],
)
def test_one_chief_and_the_first_line_counts_replicas(kind, first):
    done = loom_run(["run", "--nproc", "2", str(SCRIPTS / "chief_job.py"), kind], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.splitlines()[0] == first, done.stderr[-3000:]
    assert done.stderr.count("loom: ") == 1
    counts = {text: done.stdout.count(text) for text in ("is_chief=True", "is_chief=False", "printed once")}
    assert counts == {"is_chief=True": 1, "is_chief=False": 1, "printed once": 1}, done.stdout  # two processes' lines may interleave
