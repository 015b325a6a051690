"""torch's thread count is process-wide: a strategy sets it only where loom owns the process
(its launcher sets LOOM_THREADS) or the user asks (LOOM_THREADS); under ``auto`` it divides the
host's cores among every loom process on it."""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import loom
from loom import devices
from loom.devices import THREADS_ENV, apply_thread_budget, available_cores, thread_budget
from loom.errors import LaunchError
from loom.launch.torchrun import LaunchOptions
from tests.helpers import run_ranks


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_budget_is_set_only_when_asked(monkeypatch, threads_restored):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    torch.set_num_threads(1)
    assert apply_thread_budget(1) is None and torch.get_num_threads() == 1
    monkeypatch.setenv(THREADS_ENV, "2")
    assert apply_thread_budget(4) == 2 and torch.get_num_threads() == 2
    monkeypatch.setenv(THREADS_ENV, "auto")
    assert apply_thread_budget(1) == thread_budget(1) == torch.get_num_threads()
    monkeypatch.setenv(THREADS_ENV, "many")
    with pytest.raises(LaunchError, match="LOOM_THREADS='many' is not a number of threads: use a positive number, or 'auto' for cores / local processes"):
        apply_thread_budget(1)


def test_oversubscribed_threads_left_as_they_are_are_named_once(monkeypatch, threads_restored):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    torch.set_num_threads(2)
    processes = available_cores()  # two threads each: twice the cores
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_thread_budget(processes)
        apply_thread_budget(processes)
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and f"{processes} processes on this machine with 2 threads each oversubscribe" in said[0]
    assert torch.get_num_threads() == 2


def _mirrored_threads(asked: str | None) -> tuple[int, int | None]:
    """One strategy in a process started by plain torchrun (``asked`` None) or by ``loom run --threads``."""
    os.environ.pop(THREADS_ENV)
    if asked is not None:
        os.environ[THREADS_ENV] = asked
    torch.set_num_threads(1)
    strategy = loom.MirroredStrategy()
    return torch.get_num_threads(), strategy.threads


def test_a_strategy_leaves_the_thread_count_of_a_process_loom_does_not_own():
    [left] = run_ranks(_mirrored_threads, 1, None, timeout=120)
    [asked] = run_ranks(_mirrored_threads, 1, "2", timeout=120)
    assert left == (1, None) and asked == (2, 2)


def test_tf_config_workers_on_this_host_are_counted_by_the_launcher(monkeypatch):
    workers = ["127.0.0.1:2222", "localhost:2223", "10.255.0.9:2222"]  # two here, one elsewhere
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": 0}}))
    opts = LaunchOptions()
    assert opts.processes_on_host() == 2
    assert opts.threads_per_process() == thread_budget(2) == max(1, available_cores() // 2)
    assert LaunchOptions(threads=3).threads_per_process() == 3  # --threads wins


def test_live_processes_of_other_jobs_are_counted_and_dead_ones_dropped(monkeypatch, capsys, threads_restored):
    monkeypatch.setenv(devices.THREADS_ENV, "auto")  # as loom run sets it without --threads
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


def test_loom_stacks_finds_a_job_by_the_registry_whatever_its_workers_started_with(monkeypatch, tmp_path):
    from loom.comm.stacks import local_masters

    monkeypatch.setenv(devices.REGISTRY_ENV, str(tmp_path))
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29512")
    monkeypatch.setenv(devices.HOST_PROCESSES_ENV, "2")  # as loom run sets it
    devices.register_process()  # a worker forked from a zygote: /proc holds the zygote's start environment
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    (devices.registry_dir() / dead).write_text("10.9.9.9:1")
    assert devices.registered_masters() == {"10.1.2.3:29512"}
    assert "10.1.2.3:29512" in local_masters() and "10.9.9.9:1" not in local_masters()



REGISTER_AND_COUNT = """
from loom import devices
for _ in range(500):
    devices.register_process()
    devices.live_processes()
"""


def test_processes_registering_and_counting_at_once_never_fail(monkeypatch, tmp_path):
    """A count removes what is not a live process's entry: a registration must never leave one half-made."""
    from tests.helpers import job_env, popen

    script = tmp_path / "register_and_count.py"
    script.write_text(REGISTER_AND_COUNT)
    env = job_env({devices.REGISTRY_ENV: str(tmp_path / "registry")})
    procs = [popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in outputs]
