"""The examples run and learn."""

import subprocess
import sys

from tests.helpers import ROOT, start_nodes, wait_all

EXAMPLES = ROOT / "examples"


def test_one_device_example():
    done = subprocess.run([sys.executable, str(EXAMPLES / "one_device_digits.py")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    accuracy = float(done.stdout.strip().rsplit(" ", 1)[1])
    assert accuracy >= 0.95, done.stdout


def test_multi_worker_example_on_two_local_nodes():
    results = wait_all(start_nodes(2, 1, [str(EXAMPLES / "multi_worker_digits.py")]), timeout=180)
    for code, _, err in results:
        assert code == 0, err
    chief_out = results[0][1]
    assert "MultiWorkerMirroredStrategy, 2 replica(s): test accuracy: " in chief_out
    assert float(chief_out.strip().rsplit(" ", 1)[1]) >= 0.95
