"""FaultTolerantDiLoCoStrategy under ``loom run --groups``: rounds of 3 global batches, each group training alone within one.

Launched jobs of ``tests/scripts/ft_train.py`` (Adam, StepLR, a clipped gradient norm): without failure, 2 groups of 2
processes end where DiLoCo simulated in one process ends (two replicas, each on its half of every global batch, an outer
Nesterov step every round). With group 1 killed in the middle of a round: the round is not applied, group 0 trains its
batches again alone, group 1 comes back, heals from group 0's round start in the next round's quorum, trains that round
with it and ends bit-identical to it; every sample is trained once, and the weights equal the simulation of the rounds as
they were taken. In-process tests check a meeting's arithmetic on buffers and the refusals.
"""

import copy
import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import loom

pytest.importorskip("torchft", reason="the ft extra: pip install loom[ft]")  # installed by make

from loom.checkpoint.layout import step_dir  # noqa: E402
from loom.data.sharding import epoch_order  # noqa: E402
from loom.strategies.data_parallel.fault_tolerant_data import group_slice  # noqa: E402
from tests.strategies.ft_jobs import assert_close, finish, ft_train, kill_the_dying_group, no_job_left, read_steps, samples_per_epoch, start_job  # noqa: E402, F401

H = 3
ROUNDS = [(first, min(H, 8 - first)) for first in range(0, 8, H)]  # each epoch's rounds: batches 0-2, 3-5, 6-7


def rounds_taken(steps, group_size):
    """Each applied round of the job, from group 0's steps: (first batch, length, groups that trained it, a group that
    healed in its quorum)."""
    mine = {s["batch"]: s for s in steps if s["g"] == 0 and s["rank"] == 0}
    healed = min((s["batch"] for s in steps if s["g"] == 1 and s["restart"] == 1), default=None)
    taken = []
    for epoch in range(ft_train.EPOCHS):
        for first, length in ROUNDS:
            s = mine[epoch * 8 + first]
            trained = [0, 1] if s["replicas"] == 2 * group_size else [0]
            taken.append((epoch * 8 + first, length, trained, 1 if epoch * 8 + first == healed else None))
    return taken


def simulated(group_size, rounds, resumed_at=None):
    """DiLoCo in one process, on the rounds as the job took them: each training group with its own Adam, StepLR and
    clipping, on its share of each global batch; a group healing in a round's quorum takes group 0's round start. A job
    resumed from a checkpoint at batch ``resumed_at`` starts every group from the writer's (group 0's) optimizer."""
    data, orders = ft_train.Numbered(), {}
    groups = {g: ft_train.make_model(1) for g in (0, 1)}  # group 0's start-up weights
    opts = {g: ft_train.optimizer(m.parameters()) for g, m in groups.items()}
    scheds = {g: ft_train.scheduler(o) for g, o in opts.items()}
    anchor = [p.detach().clone() for p in groups[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=0.7, momentum=0.9, nesterov=True)
    for first, length, trained, healing in rounds:
        if first == resumed_at:
            for g in groups:
                opts[g].load_state_dict(copy.deepcopy(opts[0].state_dict()))
        if healing is not None:
            opts[healing].load_state_dict(copy.deepcopy(opts[0].state_dict()))
            scheds[healing].load_state_dict(copy.deepcopy(scheds[0].state_dict()))
        for rank, g in enumerate(trained):
            start, stop = group_slice(ft_train.BATCH, group_size, rank, len(trained))
            for batch in range(first, first + length):
                epoch = batch // 8
                order = orders.setdefault(epoch, epoch_order(ft_train.SAMPLES, True, 0, epoch))
                ids = order[(batch % 8) * ft_train.BATCH :][start:stop]
                opts[g].zero_grad()
                F.cross_entropy(groups[g](data.x[ids]), data.y[ids]).backward()
                torch.nn.utils.clip_grad_norm_(groups[g].parameters(), ft_train.MAX_NORM)
                opts[g].step()
                scheds[g].step()
        with torch.no_grad():
            for i, a in enumerate(anchor):
                a.grad = sum((a - list(groups[g].parameters())[i]) * ((stop_ - start_) / ft_train.BATCH)
                             for rank, g in enumerate(trained)
                             for start_, stop_ in [group_slice(ft_train.BATCH, group_size, rank, len(trained))])  # fmt: skip
            outer.step()
            outer.zero_grad()
            for model in groups.values():
                for p, a in zip(model.parameters(), anchor):
                    p.copy_(a)
    return groups[0].state_dict(), {g: ft_train.schedule_state(opts[g], scheds[g]) for g in groups}


def assert_every_sample_once(steps):
    for epoch, count in samples_per_epoch(steps).items():
        assert count == Counter(range(96)), f"epoch {epoch}: lost {set(range(96)) - set(count)}, doubled {[i for i, n in count.items() if n > 1]}"


@pytest.mark.timeout(300)
def test_diloco_groups_without_failure_equal_diloco_simulated_on_the_groups_shares(tmp_path):
    job = start_job(tmp_path, "--groups", "2", "--nproc", "2", env={"STRATEGY": "diloco", "SAVE_EVERY": "2"})
    finish(job, 280)
    steps = read_steps(tmp_path)
    assert {s["replicas"] for s in steps} == {4} and {tuple(s["groups"]) for s in steps} == {(0, 1)}
    assert_every_sample_once(steps)
    final = {(g, r): torch.load(tmp_path / f"final-{g}-{r}.pt") for g in (0, 1) for r in (0, 1)}
    assert all(torch.equal(final[0, 0][k], final[g, r][k]) for g, r in final for k in final[0, 0])  # every round ends agreed
    weights, schedules = simulated(2, [(e * 8 + first, length, [0, 1], None) for e in range(2) for first, length in ROUNDS])
    assert_close(final[0, 0], weights)
    for g, r in final:
        assert json.loads((tmp_path / f"lr-{g}-{r}.json").read_text()) == schedules[g]

    # Saved every 2 batches by group 0, inside rounds too: what the groups agree on restores under any strategy (inside a
    # round, the round's start: at batch 2, the job's first weights)...
    for step, want in ((16, final[0, 0]), (2, ft_train.make_model(1).state_dict())):
        model = ft_train.make_model(0)
        assert loom.OneDeviceStrategy("cpu").restore(step_dir(tmp_path / "checkpoints", step), model=model)["step"] == step
        assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    # ...and a job of the groups resumed from batch 10's (2 steps into the round of batches 8-10) trains that round again
    # and goes on as the simulation says: the outer momentum restored, every group from the writer's optimizer state
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    step_dir(tmp_path / "checkpoints", 10).rename(step_dir(resumed / "checkpoints", 10))
    job = start_job(resumed, "--groups", "2", "--nproc", "1", env={"STRATEGY": "diloco", "RESUME_FROM": str(resumed / "checkpoints")})
    finish(job, 200)  # groups of one process now: each group's half of a batch is the same samples
    assert sorted({s["batch"] for s in read_steps(resumed)}) == list(range(8, 24))  # the script's 2 epochs from the restored one
    weights, _ = simulated(2, [(e * 8 + first, length, [0, 1], None) for e in range(3) for first, length in ROUNDS], resumed_at=8)
    assert_close(torch.load(resumed / "final-1-0.pt"), weights)


@pytest.mark.timeout(300)
def test_a_diloco_group_killed_mid_round_heals_from_the_round_start_and_no_sample_is_lost_or_doubled(tmp_path):
    die_at, hold_at = 4, 5  # the middle of the round of batches 3-5; hold after that round, redone by group 0 alone
    job = start_job(tmp_path, "--groups", "2", "--nproc", "1", "--max-restarts", "1",
                    env={"STRATEGY": "diloco", "DIE_AT": f"1:{die_at}", "HOLD_AT": str(hold_at)})  # fmt: skip
    err = kill_the_dying_group(job, tmp_path)

    steps = read_steps(tmp_path)
    survivor = [s for s in steps if s["g"] == 0]
    assert {(s["pid"], s["restart"]) for s in survivor} == {(survivor[0]["pid"], 0)}  # never restarted
    assert [s["batch"] for s in survivor] == list(range(16))  # every batch once: the round group 1 died in, redone alone
    assert all(s["groups"] == [0] for s in survivor if 3 <= s["batch"] <= 5)
    assert [s["batch"] for s in steps if s["g"] == 1 and s["restart"] == 0] == [0, 1, 2]  # its half-trained round was dropped
    healed = [s for s in steps if s["g"] == 1 and s["restart"] == 1]
    assert healed and healed[0]["batch"] > hold_at and healed[-1]["batch"] == 15
    assert_every_sample_once(steps)
    final0, final1 = (torch.load(tmp_path / f"final-{g}-0.pt") for g in (0, 1))
    assert all(torch.equal(final0[k], final1[k]) for k in final0)  # bit-identical after healing
    weights, schedules = simulated(1, rounds_taken(steps, 1))
    assert_close(final0, weights)  # the rounds as they were taken: none half-applied, none applied twice
    for g in (0, 1):
        assert json.loads((tmp_path / f"lr-{g}-0.json").read_text()) == schedules[g]
    assert "batches 3-5 not applied: a group failed during their round" in err
    assert "group 1 left at batch" in err and "group 1 healed at batch" in err


class _Buffered(torch.nn.Module):
    """A parameter and one buffer of each kind a meeting treats apart."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))
        self.register_buffer("running", torch.zeros(3))  # BatchNorm's statistics: moved by training
        self.register_buffer("constant", torch.tensor([0.1, 0.2, 0.3]))  # a frequency table: never moved
        self.register_buffer("count", torch.tensor(5))  # num_batches_tracked
        self.register_buffer("mask", torch.ones(3, dtype=torch.bool))  # a causal mask


def _group(trained: float, seen: int, participants: int):
    """A group's strategy at its meeting, after a round that moved ``w`` and ``running`` by ``trained`` and counted ``seen``."""
    strategy = object.__new__(loom.FaultTolerantDiLoCoStrategy)  # only a meeting's arithmetic, no job
    strategy.outer_lr, strategy.outer_momentum, strategy._optimizer, strategy._schedulers = 1.0, 0.0, torch.optim.SGD([torch.zeros(1)], lr=1), []
    strategy._manager = SimpleNamespace(num_participants=lambda: participants)
    module = _Buffered()
    strategy._before_start(module)
    with torch.no_grad():
        module.w.add_(trained)
        module.running.add_(trained)
        module.count.add_(seen)
    return strategy, module


def test_a_meeting_moves_the_buffers_by_the_groups_weighted_change_and_leaves_unmoved_and_boolean_ones_exact():
    """Two groups of unequal shares (3/4 and 1/4 of the batches): they end equal, a buffer no group moved keeps its
    exact value, an integer one moves by the mean change, and a boolean one is left as it is."""
    groups = [(*_group(trained=4.0, seen=3, participants=2), 0.75), (*_group(trained=-4.0, seen=3, participants=2), 0.25)]
    sent = [strategy._meeting_tensors(weight) for strategy, _, weight in groups]
    summed = [sum(parts) for parts in zip(*sent)]  # the all-reduce across the groups
    for strategy, _, _ in groups:
        strategy._apply_meeting([t.clone() for t in summed])
    for _, module, _ in groups:
        assert module.w.tolist() == [2.0] * 3  # the outer step (lr 1, no momentum) to the weighted mean: 0.75*4 - 0.25*4
        assert module.running.tolist() == [2.0] * 3
        assert torch.equal(module.constant, _Buffered().constant) and module.count.item() == 8 and module.mask.tolist() == [True] * 3


def test_diloco_across_groups_refuses_bad_options_a_stray_step_and_a_parameter_frozen_after_prepare_in_one_line():
    with pytest.raises(ValueError, match=r"^FaultTolerantDiLoCoStrategy\(sync_every=...\) must be a positive number of optimizer steps, got 0$"):
        loom.FaultTolerantDiLoCoStrategy(sync_every=0)
    with pytest.raises(ValueError, match=r"^FaultTolerantDiLoCoStrategy needs outer_lr > 0 and 0 <= outer_momentum < 1"):
        loom.FaultTolerantDiLoCoStrategy(outer_momentum=1.0)
    from loom.strategies.data_parallel.fault_tolerant_diloco import _Round

    strategy, module = _group(trained=1.0, seen=1, participants=1)
    stepped = []
    with pytest.raises(RuntimeError, match=r"^under --groups each optimizer step trains the batch that strategy.distribute\(...\) hands out"):
        strategy._inner_step(lambda: stepped.append(1))  # no batch handed out: a second step for one batch, or one before any
    assert not stepped  # refused before the update
    strategy._round, strategy.membership, strategy._global_batch = _Round(first=0, length=1), SimpleNamespace(samples=1, quorum_id=1, groups=(0,)), 1
    module.w.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"^a parameter was frozen or unfrozen after prepare\(\): FaultTolerantDiLoCoStrategy meets the parameters"):
        strategy._meet()
