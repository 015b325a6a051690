"""The CPU thread budget divides the host's cores among every loom process on it."""

import json
import subprocess
import sys

import pytest
import torch

from loom import devices
from loom.devices import available_cores, thread_budget
from loom.launch.torchrun import LaunchOptions


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_tf_config_workers_on_this_host_are_counted_by_the_launcher(monkeypatch):
    workers = ["127.0.0.1:2222", "localhost:2223", "10.255.0.9:2222"]  # two here, one elsewhere
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": 0}}))
    opts = LaunchOptions()
    assert opts.processes_on_host() == 2
    assert opts.threads_per_process() == thread_budget(2) == max(1, available_cores() // 2)
    assert LaunchOptions(threads=3).threads_per_process() == 3  # --threads wins


def test_live_processes_of_other_jobs_are_counted_and_dead_ones_dropped(monkeypatch, capsys, torch_threads):
    monkeypatch.delenv(devices.THREADS_ENV, raising=False)
    monkeypatch.delenv(devices.HOST_PROCESSES_ENV, raising=False)
    registry = devices.registry_dir()
    registry.mkdir(parents=True, exist_ok=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (registry / dead).touch()
        (registry / str(other.pid)).touch()  # another job's process, alive
        threads = devices.apply_thread_budget(1)
        assert threads == torch.get_num_threads() == thread_budget(2)
        assert devices.live_processes() == 2  # this one and the other job's
        assert not (registry / dead).exists()
        line = capsys.readouterr().err
        assert line == (
            f"loom: 2 loom processes share this host's {available_cores()} cores (another job?); this one takes "
            f"{threads} thread(s): pass --threads {threads} to each job to keep the others from taking more\n"
        )
    finally:
        other.communicate(b"")
    assert devices.live_processes() == 1
