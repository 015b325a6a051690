"""A replica group's training script for the --groups tests: Adam on 96 numbered samples, 2 epochs of 8 global batches,
through ``train_step`` with a StepLR schedule (chainable: each learning rate is computed from the last) and a
gradient norm clipped to MAX_NORM (about half of the steps clip). ``STRATEGY=sharded``: FaultTolerantShardedStrategy;
``STRATEGY=diloco``: FaultTolerantDiLoCoStrategy(sync_every=SYNC_EVERY), rounds of 3 batches by default.
``ACCUMULATE=k``: ``train_step(accumulate=k)``, k micro-batches to a step.

``SAVE_EVERY=k``: after every k-th batch the groups save (OUT/checkpoints/step-<batches>); with ``DIE_IN=save``, group G
of ``DIE_AT`` dies in the save after batch B instead, its files written and not committed (B + 1 a multiple of k).

``PAUSE_AT=B``: every process writes OUT/paused-<group>-<rank> after batch B and waits for OUT/go.

``RESUME_FROM=DIR``: restore that checkpoint (model, optimizer, scheduler, data position) before the first batch.

``CHECK_REFUSALS=1``: first try what the strategy refuses and save the lines as OUT/refusals-<group>-<rank>.json
(and, at the end, a step after ``leave()`` as OUT/left-<group>-<rank>.json).

``ft_train.py OUT``: every process appends each committed step (its batch, groups and sample ids; under DiLoCo, the
steps of each applied round, once it applied)
to OUT/steps.jsonl and saves its final weights as OUT/final-<group>-<rank>.pt. ``DIE_AT=G:B``:
group G's first life stops before the sync of batch B and waits to be killed (OUT/dying holds
its pid); its next life joins only once the other group committed batch B without it (else a quick
restart, within the lighthouse's heartbeat timeout, would heal in that very step); the final learning rate and scheduler state go to OUT/lr-<group>-<rank>.json. ``HOLD_AT=B``: the other groups wait after batch B until group G's next life asks to
join, and after each later batch a while for it to heal, so that it rejoins while there is training left. ``LATE=G``: group G's first life starts
only once group 0 waits for it to start the job (its ``waiting`` event), or else has trained up to
HOLD_AT without it; then group 0 is stopped (SIGSTOP, as a busy machine may hold a process) until
group G stops to be killed, so that its heartbeat lapses and group G's quorums lack it.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import loom

SAMPLES, BATCH, EPOCHS = 96, 12, 2
MAX_NORM = 0.51


class Numbered(torch.utils.data.Dataset):
    """Sample i is (x_i, y_i, i): the id says which samples a step trained."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 8, generator=g)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def make_model(seed: int) -> nn.Module:
    """Odd sizes: FSDP2 cuts 15 and 3 rows into uneven shards."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 15), nn.ReLU(), nn.Linear(15, 3))


def optimizer(params):
    """Two parameter groups, biases first: not the model's order."""
    params = list(params)
    return torch.optim.Adam([{"params": params[1::2]}, {"params": params[::2], "lr": 0.02}], lr=0.01)


def evaluation_data() -> torch.utils.data.Dataset:
    """The training samples less 5: the last batch is partial (evaluation pads it, and leaves the padding out)."""
    numbered = Numbered()
    return torch.utils.data.TensorDataset(numbered.x[:-5], numbered.y[:-5])


def scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)


def schedule_state(opt, sched) -> dict:
    return {"lr": [group["lr"] for group in opt.param_groups], "last_epoch": sched.last_epoch}


def make_strategy(name: str | None) -> loom.Strategy:
    if name == "sharded":
        return loom.FaultTolerantShardedStrategy()
    if name == "diloco":
        return loom.FaultTolerantDiLoCoStrategy(sync_every=int(os.environ.get("SYNC_EVERY", 3)))
    return loom.auto_strategy()


def _events(group: int) -> list[dict]:
    path = Path(os.environ["LOOM_FT_EVENTS"]) / f"group-{group}.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(l) for l in text[: text.rfind("\n") + 1].splitlines()]  # a line being written is read next time


def _rejoining(group: int) -> bool:
    return any(e["event"] == "joining" and e["restart"] > 0 for e in _events(group))


def _hold(at_hold: bool, rejoining: int) -> None:
    """At HOLD_AT, wait until the group asks to join; past it, up to 5 s a batch until it healed.

    Its first quorum request may reach the lighthouse after the others' next ones (a busy machine
    holds its thread): those quorums form without it, and it would join only in the last batch.
    """
    if at_hold:
        while not _rejoining(rejoining):
            time.sleep(0.05)
        return
    deadline = time.monotonic() + 5
    while not any(e["event"] == "healed" for e in _events(rejoining)) and time.monotonic() < deadline:
        time.sleep(0.05)


def _start_late(out: Path, hold_at: int) -> int | None:
    """Wait until group 0 waits for this group, or trained up to HOLD_AT without it; in that case stop it: its pid."""
    while not any(e["event"] == "waiting" for e in _events(0)):
        if any(e["event"] == "commit" and e["batch"] == hold_at for e in _events(0)):
            survivor = next(s["pid"] for s in map(json.loads, (out / "steps.jsonl").read_text().splitlines()) if s["g"] == 0)
            os.kill(survivor, signal.SIGSTOP)
            return survivor
        time.sleep(0.05)
    return None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard


def _refusal(call) -> str:
    try:
        call()
    except (ValueError, RuntimeError) as error:
        return str(error)
    return "not refused"


def registered(out: Path) -> None:
    """This process's pid and start time in OUT/pids, so that a test that fails can end what its job left running
    (workers forked from a zygote outlive their launcher)."""
    (out / "pids").mkdir(exist_ok=True)
    (out / "pids" / str(os.getpid())).write_text(started_at("self"))


def started_at(pid: str) -> str:
    """When a process started, in clock ticks since boot (/proc/PID/stat's 22nd field): with its pid, who it is."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _die_before_the_commit(out: Path) -> None:
    """The next save writes its files, then waits to be killed before its commit (OUT/dying holds the pid)."""
    from loom.checkpoint.checkpointer import Checkpointer

    def commit(*args, **kwargs):
        (out / "dying").write_text(str(os.getpid()))
        while True:
            time.sleep(0.05)

    Checkpointer._commit = commit


def main(out: Path) -> None:
    registered(out)
    hold_at = int(os.environ.get("HOLD_AT", -1))
    die_group, die_batch = map(int, os.environ.get("DIE_AT", "-1:-1").split(":"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    late = os.environ.get("LATE") == os.environ["REPLICA_GROUP_ID"] and not restart
    stopped = _start_late(out, hold_at) if late else None
    in_save, save_every = os.environ.get("DIE_IN") == "save", int(os.environ.get("SAVE_EVERY", 0))
    pause_at = int(os.environ.get("PAUSE_AT", -1))
    if restart and int(os.environ["REPLICA_GROUP_ID"]) == die_group:  # rejoin once the others trained on without it
        while not any(e["event"] == "commit" and e.get("first", e["batch"]) <= die_batch + in_save <= e["batch"] for e in _events(1 - die_group)):
            time.sleep(0.05)
    strategy = make_strategy(os.environ.get("STRATEGY"))
    group, rank = strategy.group, strategy.cluster.rank
    if os.environ.get("CHECK_REFUSALS"):
        refusals = [_refusal(lambda: strategy.prepare(make_model(0)))]
    model, opt = strategy.prepare(make_model(group + 1), optimizer)  # groups start unequal: the start-up sync makes them equal
    if os.environ.get("CHECK_REFUSALS"):
        refusals += [_refusal(lambda: strategy.prepare(make_model(0), optimizer)), _refusal(opt.step)]
        refusals += [_refusal(lambda: next(iter(strategy.distribute(Numbered(), batch_size=13 * 4))))]
        (out / f"refusals-{group}-{rank}.json").write_text(json.dumps(refusals))
    sched = scheduler(opt)
    step = strategy.train_step(model, F.cross_entropy, opt, scheduler=sched, max_grad_norm=MAX_NORM, accumulate=int(os.environ.get("ACCUMULATE", 1)))
    loader = strategy.distribute(Numbered(), batch_size=BATCH, shuffle=True)
    if os.environ.get("RESUME_FROM"):
        strategy.restore(os.environ["RESUME_FROM"], model=model, optimizer=opt, scheduler=sched, loader=loader)
    pending = []  # steps trained whose round has not met yet
    with open(out / "steps.jsonl", "a") as log:
        for _ in range(EPOCHS):
            for x, y, ids in loader:
                m = strategy.membership
                if (group, m.batch, restart) == (die_group, die_batch, 0) and not in_save:
                    if stopped is not None:
                        os.kill(stopped, signal.SIGCONT)
                    (out / "dying").write_text(str(os.getpid()))
                    while True:  # killed here, mid-step: after its forward pass would run, before the sync
                        time.sleep(0.05)
                step(x, y)
                pending.append({"g": group, "rank": rank, "pid": os.getpid(), "restart": restart, "batch": m.batch,
                                "groups": m.groups, "ids": ids.tolist(), "replicas": strategy.num_replicas_in_sync,
                                "norm": float(step.grad_norm)})  # fmt: skip
                if strategy.committed is not None:  # the step (a DiLoCo round) applied, or not
                    log.writelines(json.dumps(s) + "\n" for s in pending if strategy.committed)
                    log.flush()
                    pending = []
                if m.batch == pause_at and strategy.committed:  # until the test says go (it kills the lighthouse meanwhile)
                    (out / f"paused-{group}-{rank}").write_text("")
                    while not (out / "go").exists():
                        time.sleep(0.05)
                if save_every and strategy.committed is not False and (m.batch + 1) % save_every == 0:  # DiLoCo: in a round too
                    if (group, m.batch, restart) == (die_group, die_batch, 0) and in_save:
                        _die_before_the_commit(out)
                    strategy.save(out / "checkpoints", step=m.batch + 1, keep=100, model=model, optimizer=opt, scheduler=sched, loader=loader)
                if 0 <= hold_at <= m.batch and group != die_group and strategy.committed:
                    _hold(m.batch == hold_at, die_group)
    evaluated = loom.evaluate(model, F.cross_entropy, evaluation_data(), batch_size=BATCH, strategy=strategy)
    (out / f"eval-{group}-{rank}.json").write_text(json.dumps(evaluated))
    final = loom.unwrap(model).state_dict()
    (out / f"held-{group}-{rank}.json").write_text(json.dumps({k: _local(v).numel() for k, v in final.items()}))
    torch.save({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in final.items()}, out / f"final-{group}-{rank}.pt")
    (out / f"lr-{group}-{rank}.json").write_text(json.dumps(schedule_state(opt, sched)))
    if os.environ.get("CHECK_REFUSALS"):  # having left the groups, the strategy takes no step
        strategy.leave()
        (out / f"left-{group}-{rank}.json").write_text(json.dumps(_refusal(lambda: next(iter(loader)))))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
