"""FaultTolerantMirroredStrategy under ``loom run --groups``: exact data through a kill -9, healing, equivalence.

Two launched jobs, each shared by several assertions. Without failure, 2 groups of 2 processes
end where OneDeviceStrategy on the global batch ends. With group 1 killed in the middle of a
step: the step is not applied and is trained again by group 0 alone, group 0 is never
restarted, group 1 comes back, heals from group 0 (no checkpoint exists) and ends bit-identical
to it, its StepLR schedule included; every sample of every epoch is trained exactly once, and the
weights and learning rate still equal OneDevice's (the schedule steps only on applied steps).
Group 1 starts late (``LATE``): the job's start waits for it, and if group 0 had started without
it, group 0 would be stopped until group 1 dies, as a busy machine stops a heartbeat.
"""

import importlib.util
import json
import subprocess
import time
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import loom
from tests.helpers import LOOM, ROOT, SCRIPTS, job_env

pytest.importorskip("torchft", reason="the ft extra: pip install loom[ft]")  # installed by make

spec = importlib.util.spec_from_file_location("ft_train", SCRIPTS / "ft_train.py")
ft_train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ft_train)


def _one_device() -> tuple[dict[str, torch.Tensor], dict]:
    """The reference: one process trains group 0's start-up weights on every global batch, with the same
    schedule; its final weights and learning rate."""
    strategy = loom.OneDeviceStrategy("cpu")
    model, opt = strategy.prepare(ft_train.make_model(1), ft_train.optimizer)
    sched = ft_train.scheduler(opt)
    step = strategy.train_step(model, F.cross_entropy, opt, scheduler=sched)
    loader = strategy.distribute(ft_train.Numbered(), batch_size=ft_train.BATCH, shuffle=True)
    for _ in range(ft_train.EPOCHS):
        for x, y, _ids in loader:
            step(x, y)
    return loom.unwrap(model).state_dict(), ft_train.schedule_state(opt, sched)


def _start(out, *flags, env=None):
    return subprocess.Popen(
        [*LOOM, "run", *flags, str(SCRIPTS / "ft_train.py"), str(out)],
        cwd=ROOT, env=job_env({"LOOM_TIMEOUT": "60", **(env or {})}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _finish(job, timeout):
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate()
        pytest.fail(f"the job did not finish within {timeout}s:\n{err[-3000:]}")
    assert job.returncode == 0, err[-3000:]
    return err


def _steps(out):
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def _assert_close(a, b):
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def _samples_per_epoch(steps):
    """Sample ids trained in each epoch, counted once per process slice of each committed batch."""
    epochs: dict[int, Counter] = {}
    for s in steps:
        epochs.setdefault(s["batch"] // 8, Counter()).update(s["ids"])
    return epochs


@pytest.mark.timeout(300)
def test_groups_without_failure_equal_one_device(tmp_path):
    job = _start(tmp_path, "--groups", "2", "--nproc", "2", env={"CHECK_REFUSALS": "1"})
    _finish(job, 280)
    steps = _steps(tmp_path)
    assert {s["replicas"] for s in steps} == {4}  # 2 groups x 2 processes
    assert all(c == Counter(range(96)) for c in _samples_per_epoch(steps).values())
    final = {(g, r): torch.load(tmp_path / f"final-{g}-{r}.pt") for g in (0, 1) for r in (0, 1)}
    weights, schedule = _one_device()
    for g, r in final:
        _assert_close(final[g, r], weights)
        assert json.loads((tmp_path / f"lr-{g}-{r}.json").read_text()) == schedule
    refusals = json.loads((tmp_path / "refusals-1-1.json").read_text())
    assert refusals[0].startswith("under --groups a restarted group heals with the optimizer's state too: pass the optimizer")
    assert refusals[1] == "FaultTolerantMirroredStrategy trains one model and optimizer: call prepare() once"
    assert refusals[2].startswith("under --groups each step trains the batch that strategy.distribute(...) hands out")
    assert refusals[3].startswith("under --groups every step trains a whole global batch, but 96 samples leave a last batch of 44")


def test_fp16_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"cannot heal fp16's loss scale: use precision='bf16-mixed' or '32'"):
        loom.FaultTolerantMirroredStrategy(precision="16-mixed")


@pytest.mark.timeout(300)
def test_a_group_killed_mid_step_heals_from_a_live_group_and_no_sample_is_lost_or_doubled(tmp_path):
    die_at, hold_at = 3, 5
    job = _start(tmp_path, "--groups", "2", "--nproc", "1", "--max-restarts", "1", env={"DIE_AT": f"1:{die_at}", "HOLD_AT": str(hold_at), "LATE": "1"})
    deadline = time.monotonic() + 240
    dying = tmp_path / "dying"
    while not (dying.exists() and dying.read_text()):  # the pid, once written whole
        assert job.poll() is None, job.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "group 1 never reached the batch it dies in"
        time.sleep(0.05)
    subprocess.run(["kill", "-9", dying.read_text()], check=True)
    err = _finish(job, max(deadline - time.monotonic(), 30))

    steps = _steps(tmp_path)
    survivor = [s for s in steps if s["g"] == 0]
    assert {(s["pid"], s["restart"]) for s in survivor} == {(survivor[0]["pid"], 0)}  # never restarted
    assert [s["batch"] for s in survivor] == list(range(16))  # every batch, the killed one once (redone alone)
    assert next(s for s in survivor if s["batch"] == die_at)["groups"] == [0]
    first_life = [s for s in steps if s["g"] == 1 and s["restart"] == 0]
    assert first_life and all(s["groups"] == [0, 1] for s in first_life)  # it started late, but never started the job again alone
    healed = [s for s in steps if s["g"] == 1 and s["restart"] == 1]
    assert healed and healed[0]["batch"] > hold_at and healed[-1]["batch"] == 15  # took up where the job was
    for epoch, count in _samples_per_epoch(steps).items():
        assert count == Counter(range(96)), f"epoch {epoch}: lost {set(range(96)) - set(count)}, doubled {[i for i, n in count.items() if n > 1]}"
    final0, final1 = (torch.load(tmp_path / f"final-{g}-0.pt") for g in (0, 1))
    assert all(torch.equal(final0[k], final1[k]) for k in final0)  # bit-identical after healing
    weights, schedule = _one_device()
    _assert_close(final0, weights)  # and still the one-device run: no batch lost or applied twice
    lr0, lr1 = (json.loads((tmp_path / f"lr-{g}-0.json").read_text()) for g in (0, 1))
    assert lr0 == lr1 == schedule  # the schedule healed too, and stepped only on applied steps
    assert f"batch {die_at} not applied" in err
    assert "group 1 left at batch" in err and "group 1 rejoined at batch" in err and "group 1 healed at batch" in err
    assert not list(tmp_path.glob("**/*checkpoint*"))
