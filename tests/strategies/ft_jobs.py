"""Launching ``tests/scripts/ft_train.py`` under ``loom run --groups`` and reading what it trained: shared by the FT tests."""

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F

import loom
from tests.helpers import LOOM, ROOT, SCRIPTS, job_env, popen

spec = importlib.util.spec_from_file_location("ft_train", SCRIPTS / "ft_train.py")
ft_train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ft_train)


def one_device() -> tuple[dict[str, torch.Tensor], dict]:
    """The reference: one process trains group 0's start-up weights on every global batch, with the same
    schedule and clipping; its final weights and learning rate."""
    strategy = loom.OneDeviceStrategy("cpu")
    model, opt = strategy.prepare(ft_train.make_model(1), ft_train.optimizer)
    sched = ft_train.scheduler(opt)
    step = strategy.train_step(model, F.cross_entropy, opt, scheduler=sched, max_grad_norm=ft_train.MAX_NORM)
    loader = strategy.distribute(ft_train.Numbered(), batch_size=ft_train.BATCH, shuffle=True)
    for _ in range(ft_train.EPOCHS):
        for x, y, _ids in loader:
            step(x, y)
    return loom.unwrap(model).state_dict(), ft_train.schedule_state(opt, sched)


def evaluated(weights: dict[str, torch.Tensor]) -> float:
    """OneDevice's ``loom.evaluate`` loss of ``weights`` over the evaluation data."""
    model = ft_train.make_model(0)
    model.load_state_dict(weights)
    return loom.evaluate(model, F.cross_entropy, ft_train.evaluation_data(), batch_size=ft_train.BATCH, strategy=loom.OneDeviceStrategy("cpu"))["loss"]


STARTED: list = []  # the jobs this test process started, ended by ``no_job_left`` after each test


def start_job(out, *flags, env=None):
    return started(popen(
        [*LOOM, "run", *flags, str(SCRIPTS / "ft_train.py"), str(out)],
        cwd=ROOT, env=job_env({"LOOM_TIMEOUT": "60", **(env or {})}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ))  # fmt: skip


def started(job):
    STARTED.append(job)
    return job


@pytest.fixture(autouse=True)
def no_job_left(tmp_path):
    """After each test, whether it passed or not: its jobs' launchers killed, then any process of its scripts still
    running (``ft_train.registered``: workers forked from a zygote outlive their launcher and would slow the tests after)."""
    yield
    while STARTED:
        job = STARTED.pop()
        if job.poll() is None:
            job.kill()
            with contextlib.suppress(Exception):
                job.communicate(timeout=30)
    for pid_file in Path(tmp_path).rglob("pids/*"):
        end_if_still(int(pid_file.name), pid_file.read_text())


def end_if_still(pid: int, start: str) -> None:
    """SIGKILL ``pid`` if it is still the process that started at ``start`` (clock ticks since boot), not a reuse of its pid."""
    with contextlib.suppress(OSError, IndexError):
        if ft_train.started_at(str(pid)) == start:
            os.kill(pid, signal.SIGKILL)


def finish(job, timeout):
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate()
        pytest.fail(f"the job did not finish within {timeout}s:\n{err[-3000:]}")
    assert job.returncode == 0, err[-3000:]
    return err


def kill_the_dying_group(job, out, seconds=240):
    """Wait until the group that DIE_AT names stops in its step and writes its pid to OUT/dying, kill -9 it, and finish the
    job within what is left of ``seconds``: its stderr."""
    deadline = time.monotonic() + seconds
    dying = out / "dying"
    while not (dying.exists() and dying.read_text()):  # the pid, once written whole
        assert job.poll() is None, job.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the group never reached the batch it dies in"
        time.sleep(0.05)
    subprocess.run(["kill", "-9", dying.read_text()], check=True)
    return finish(job, max(deadline - time.monotonic(), 30))


def read_steps(out):
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def assert_close(a, b):
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def assert_two_groups_trained_as_one_device(out):
    """A job of 2 groups x 1 process without failure: every step by both, every sample once an epoch, and each group's
    weights and learning rate where OneDevice's are."""
    steps = read_steps(out)
    assert {s["replicas"] for s in steps} == {2} and {tuple(s["groups"]) for s in steps} == {(0, 1)}
    assert all(c == Counter(range(96)) for c in samples_per_epoch(steps).values())
    weights, schedule = one_device()
    for g in (0, 1):
        assert_close(torch.load(out / f"final-{g}-0.pt"), weights)
        assert json.loads((out / f"lr-{g}-0.json").read_text()) == schedule


def samples_per_epoch(steps):
    """Sample ids trained in each epoch, counted once per process slice of each committed batch."""
    epochs: dict[int, Counter] = {}
    for s in steps:
        epochs.setdefault(s["batch"] // 8, Counter()).update(s["ids"])
    return epochs


@contextmanager
def lighthouse(started: list | None = None) -> Iterator[str]:
    """``loom lighthouse`` in a process of its own (as on another host): its HOST:PORT, as it prints it.
    ``started`` gets its process (to kill it)."""
    proc = popen([*LOOM, "lighthouse", "--port", "0"], cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if started is not None:
        started.append(proc)
    try:
        line = proc.stdout.readline()  # its first line, or "" if it died; the test's timeout bounds the wait
        found = re.search(r"listening on (\S+);", line)
        assert found, f"loom lighthouse said {line!r}"
        yield found[1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
