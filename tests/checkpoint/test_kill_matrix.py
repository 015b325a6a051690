"""Exact resume under every strategy: kill -9 of one rank between two saves, and SIGTERM.

Each strategy trains a small model with dropout and Adam under ``loom.fit`` with a checkpoint
every two steps (``tests/scripts/kill_matrix_job.py``): the last rank kills itself with SIGKILL
after step 3, torchrun restarts the job (``--max-restarts 1``) and it resumes from step 2; after
step 7 the last rank sends itself SIGTERM, every rank saves and the job exits 0; a second launch
resumes from step 7 and finishes. The same processes then train a fresh model without any
checkpoint. Each rank's parameters and optimizer state after step 7 and at the end must equal
the uninterrupted run's bit for bit. Local SGD and DiLoCo sync every 3 steps, so every save, the
kill and the SIGTERM fall in the middle of a period (overlapped DiLoCo: with a mean in flight).

Strategies of a group run one after another in the same launched job (a launch costs seconds
of CPU): a group is one xdist group, so one test process drives it. Multi-worker mirrored is
Mirrored's code with another topology check, so Mirrored's rows stand for it (the contract and
the equivalence tests run it on two nodes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loom
from tests.helpers import SCRIPTS, loom_run, run_ranks
from tests.scripts.fit_job import data

SCRIPT = str(SCRIPTS / "kill_matrix_job.py")
KILL_AT, TERM_AT, SAVED_BEFORE_KILL = 3, 7, 2  # as in the script
GROUPS = {  # name: (processes, strategies run one after another in one job)
    "one_device": (1, ["one_device"]),
    "data_parallel": (2, ["mirrored", "local_sgd", "diloco", "diloco_overlap"]),
    "model_parallel": (2, ["sharded", "tensor_parallel", "hybrid", "pipeline"]),
}
ROWS = [pytest.param(group, name, marks=pytest.mark.xdist_group(f"kill_matrix_{group}")) for group, (_, names) in GROUPS.items() for name in names]
_ran: dict[str, tuple[Path, str, str | None]] = {}


def _matrix(group: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Run ``group``'s job until every strategy in it finished (once per test process); its directory and output."""
    if group not in _ran:
        nproc, names = GROUPS[group]
        root = tmp_path_factory.mktemp(f"kill_matrix_{group}")
        output, failed = "", None
        for _ in range(len(names) + 1):  # each SIGTERM ends a launch; the last one finishes
            done = loom_run(["run", "--nproc", str(nproc), "--max-restarts", "1", "--timeout", "30", SCRIPT, str(root), ",".join(names)], timeout=240)
            output += done.stdout + done.stderr
            if done.returncode != 0:
                failed = f"a launch failed ({done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}"
                break
            if all((root / name / "stage").read_text() == "3" for name in names):
                break
        _ran[group] = root, output, failed  # a failed job fails every test of its group, and runs once
    root, output, failed = _ran[group]
    assert failed is None, failed
    return root, output


def _differences(directory: Path, got: str, expected: str, nproc: int) -> list[str]:
    """The tensors of ``got`` that are not bit for bit ``expected``'s, on any rank, with their largest difference."""
    found = []
    for rank in range(nproc):
        a, b = (torch.load(directory / f"{name}-{rank}.pt", weights_only=True) for name in (got, expected))
        assert a.keys() == b.keys() and a, f"rank {rank}: {sorted(a)} != {sorted(b)}"
        found += [f"rank {rank} {k}: {(a[k].double() - b[k].double()).abs().max().item():.3g}" for k in a if not torch.equal(a[k], b[k])]
    return found


@pytest.mark.timeout(600)  # the first test of a group runs its job
@pytest.mark.parametrize("group, name", ROWS)
def test_kill_9_between_two_saves_resumes_bit_for_bit(group, name, tmp_path_factory):
    root, output = _matrix(group, tmp_path_factory)
    assert f"resumed from {root / name / 'checkpoints'}/step-{SAVED_BEFORE_KILL:08d}" in output, output[-4000:]
    assert not _differences(root / name, "killed", f"reference-{TERM_AT}", GROUPS[group][0])


@pytest.mark.timeout(600)  # the first test of a group runs its job
@pytest.mark.parametrize("group, name", ROWS)
def test_sigterm_save_resumes_bit_for_bit(group, name, tmp_path_factory):
    root, output = _matrix(group, tmp_path_factory)
    assert f"loom: preempted: saved step {TERM_AT} to {root / name / 'checkpoints'}" in output, output[-4000:]
    assert f"resumed from {root / name / 'checkpoints'}/step-{TERM_AT:08d}" in output, output[-4000:]
    assert not _differences(root / name, "resumed", "reference-end", GROUPS[group][0])


def _save_go_on_and_resume(directory: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Mirrored: 3 Adam steps, a save, 3 more; then a fresh model restored from the save takes the same 3."""
    strategy = loom.MirroredStrategy()
    batches = list(strategy.distribute(data(18 * 6, 0), batch_size=18, shuffle=False))

    def train(model: nn.Module, opt: torch.optim.Optimizer, few: list) -> list[torch.Tensor]:
        step = strategy.train_step(model, F.cross_entropy, opt)
        for x, y in few:
            step(x, y)
        return [p.detach().clone() for p in model.parameters()]

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        return strategy.prepare(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2)),
                                lambda p: torch.optim.Adam(p, lr=0.02))  # fmt: skip

    model, opt = fresh()
    train(model, opt, batches[:3])
    strategy.save(directory, step=3, model=model, optimizer=opt)
    went_on = train(model, opt, batches[3:])
    model, opt = fresh()
    strategy.restore(directory, model=model, optimizer=opt)
    resumed = train(model, opt, batches[3:])
    strategy.shutdown()
    return went_on, resumed


def test_mirrored_on_three_replicas_resumes_bit_for_bit(tmp_path):
    """DDP used to lay its buckets out again after the first backward: a resumed run's first step all-reduced
    in the first layout, and over three replicas the ring added some gradients up in another order."""
    for rank, (went_on, resumed) in enumerate(run_ranks(_save_go_on_and_resume, 3, str(tmp_path), timeout=120)):
        differ = [f"{(a - b).abs().max().item():.3g}" for a, b in zip(went_on, resumed) if not torch.equal(a, b)]
        assert not differ, f"rank {rank}: {differ}"
