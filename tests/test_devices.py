"""torch's thread count is process-wide: a strategy sets it only where loom owns the process
(its launcher sets LOOM_THREADS) or the user asks (LOOM_THREADS), and otherwise leaves it."""

import os
import warnings

import pytest
import torch

import loom
from loom.devices import THREADS_ENV, apply_thread_budget, available_cores, thread_budget
from loom.errors import LaunchError
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


def _mirrored_threads():
    del os.environ[THREADS_ENV]  # a process started by plain torchrun
    torch.set_num_threads(1)
    left = loom.MirroredStrategy()
    seen = (torch.get_num_threads(), left.threads)
    left.shutdown()
    os.environ[THREADS_ENV] = "2"  # started by loom run --threads 2, or asked by the user
    asked = loom.MirroredStrategy()
    return seen, (torch.get_num_threads(), asked.threads)


def test_a_strategy_leaves_the_thread_count_of_a_process_loom_does_not_own():
    [(left, asked)] = run_ranks(_mirrored_threads, 1, timeout=120)
    assert left == (1, None) and asked == (2, 2)
