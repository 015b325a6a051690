"""SIGTERM as a preemption notice is armed only where a loop can act on it (``loom.comm.preemption``)."""

import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, job_env

SCRIPT = """
import os, signal, sys
from loom.comm import preemption
how = sys.argv[1]
try:
    with preemption.armed_while():
        os.kill(os.getpid(), signal.SIGTERM)
        print("heard:", preemption.requested(), flush=True)
        if how == "raises":
            raise ValueError("a callback failed")
        if how == "exits":  # the preemption's own exit: a second SIGTERM must not cut it short
            os.kill(os.getpid(), signal.SIGTERM)
            raise SystemExit(0)
except ValueError:
    pass
print("after the block", flush=True)
"""


@pytest.mark.parametrize("how, code", [("ends", -signal.SIGTERM), ("raises", -signal.SIGTERM), ("exits", 0)])
def test_a_request_not_acted_on_ends_the_process_when_the_block_is_left(how, code):
    done = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=60, cwd=ROOT, env=job_env())
    assert done.returncode == code, done.stdout + done.stderr
    assert "heard: True" in done.stdout and "after the block" not in done.stdout
