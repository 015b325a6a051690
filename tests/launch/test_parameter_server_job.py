"""``loom run --ps N --workers M``: servers and independent workers; a killed worker is restarted alone."""

import json
import subprocess
import time

from tests.helpers import LOOM, ROOT, SCRIPTS, job_env


def _progress(out):
    path = out.with_name(out.name + ".progress")
    words = path.read_text().split() if path.exists() else []
    return [tuple(map(int, words[i : i + 3])) for i in range(0, len(words) - 2, 3)]  # (worker, pid, step)


def test_a_killed_worker_is_restarted_while_the_others_go_on_and_no_update_counts_twice(tmp_path):
    out = tmp_path / "out"
    job = subprocess.Popen(
        [*LOOM, "run", "--ps", "2", "--workers", "3", "--max-restarts", "1", str(SCRIPTS / "ps_train.py"), str(out), "60"],
        cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not [p for w, p, s in _progress(out) if w == 1 and s >= 10]:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=5)
            time.sleep(0.02)
        victim = next(p for w, p, s in _progress(out) if w == 1)
        others_before = {w: s for w, _, s in _progress(out) if w != 1}
        subprocess.run(["kill", "-9", str(victim)], check=True)
        stdout, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert f"worker 1 (pid {victim}) exited with code -9; restarting it (1 of 1), the others go on" in stderr
    steps = _progress(out)
    for worker in (0, 2):  # never restarted: one process each, all steps
        assert {p for w, p, _ in steps if w == worker} and len({p for w, p, _ in steps if w == worker}) == 1
        assert max(s for w, _, s in steps if w == worker) == 60 and others_before[worker] < 60
    incarnations = {p: max(s for w, q, s in steps if q == p) for w, p, _ in steps if w == 1}
    assert len(incarnations) == 2 and incarnations[victim] < 60 and max(incarnations.values()) == 60
    applied = json.loads(out.with_name("out.stats").read_text())
    for per_server in applied:  # every server: each push of each worker process applied once
        for name, count in per_server.items():
            pid = int(name.rsplit(".", 1)[1])
            finished = next((s for w, p, s in steps if p == pid), None) and max(s for _, p, s in steps if p == pid)
            assert count in (finished, finished + 1) if pid == victim else count == finished, (name, count, finished)
