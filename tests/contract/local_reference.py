"""What local SGD and DiLoCo should give on the contract's cases, computed without them.

These strategies do not equal one device on the global batch: each replica steps its own
optimizer on its own slice and the replicas meet every H steps. So the contract runs them
with ``OPTIONS`` (H=2 over 3 steps: one sync, then a step apart) and compares every replica
with this simulation: two threads, each a one-device replica on its slice, that take turns
(torch's generator is global, and loom's loaders seed it) and meet at a barrier every H steps and average their parameters (local SGD) or move a shared anchor with
the outer Nesterov SGD written out here by hand (DiLoCo). Overlapped DiLoCo meets every step
(H=1, so 3 steps hold two late outer steps and one still in flight): each meeting applies the
outer step on the previous meeting's mean, moves the progress made since onto it, and posts
this period's pseudo-gradient.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

import loom
from loom.strategies.optimizer import StrategyOptimizer
from tests.contract import cases

SYNC_EVERY = 2
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCoStrategy's defaults
OPTIONS: dict[str, dict[str, Any]] = {
    "local_sgd": {"sync_every": SYNC_EVERY},
    "diloco": {"sync_every": SYNC_EVERY},
    "diloco_overlap": {"sync_every": 1, "overlap_sync": True},
    "fault_tolerant_diloco": {"sync_every": SYNC_EVERY},
}
REGISTERED = {"diloco_overlap": "diloco"}  # the contract's name for a strategy with options -> the registry's name
LOCAL = tuple(OPTIONS)
OUTER = ("diloco", "diloco_overlap", "fault_tolerant_diloco")
EPOCH_ROUNDS = ("fault_tolerant_diloco",)  # its rounds end at each epoch's end too: the cases' 3 steps end agreed
SIMULATED = ("sgd_momentum", "adamw_weight_decay", "eager_loop", "bf16_mixed", "fp16_mixed", "accumulate_in_step",
             "accumulate_eager", "clipping", "step_lr")  # fmt: skip
REPLICAS = 2


class Meeting:
    """Where the two replica threads meet every ``every`` optimizer steps."""

    def __init__(self, outer: bool, every: int = SYNC_EVERY, late: bool = False, epoch: int | None = None) -> None:
        self.outer, self.every, self.late, self.epoch = outer, every, late, epoch
        self.barrier = threading.Barrier(REPLICAS, timeout=30)
        self.turn = threading.Lock()  # held by the replica that runs; let go only while waiting at the meeting
        self.posted: list[list[torch.Tensor]] = [[] for _ in range(REPLICAS)]

    def mean(self, replica: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self.posted[replica] = [t.detach().clone() for t in tensors]
        self.turn.release()
        try:
            self.barrier.wait()
            mean = [sum(ts) / REPLICAS for ts in zip(*self.posted)]
            self.barrier.wait()  # both have read before either posts again
        finally:
            self.turn.acquire()
        return mean

    @torch.no_grad()
    def meet(self, replica: int, params: list[torch.Tensor], state: dict[str, Any]) -> None:
        if self.late:
            return self.meet_late(replica, params, state)
        mean = self.mean(replica, params)
        if self.outer:
            anchor = state["anchor"]
            outer_step(anchor, state.setdefault("momentum", []), [a - m for a, m in zip(anchor, mean)])
            mean = anchor
        for p, m in zip(params, mean):
            p.copy_(m)

    def meet_late(self, replica: int, params: list[torch.Tensor], state: dict[str, Any]) -> None:
        anchor = state["anchor"]
        if "in_flight" in state:
            outer_step(anchor, state.setdefault("momentum", []), state.pop("in_flight"))
            for p, a, start in zip(params, anchor, state["start"]):
                p.add_(a - start)
        state["in_flight"] = self.mean(replica, [a - p for a, p in zip(anchor, params)])
        state["start"] = [p.clone() for p in params]


def outer_step(anchor: list[torch.Tensor], momentum: list[torch.Tensor], pseudo: list[torch.Tensor]) -> None:
    """torch's SGD with Nesterov momentum, written out."""
    if not momentum:
        momentum.extend(g.clone() for g in pseudo)
    else:
        for buf, g in zip(momentum, pseudo):
            buf.mul_(OUTER_MOMENTUM).add_(g)
    for a, g, buf in zip(anchor, pseudo, momentum):
        a.sub_(OUTER_LR * (g + OUTER_MOMENTUM * buf))


class SimulatedReplica(loom.OneDeviceStrategy):
    """One replica of a local strategy, trained in this thread on its own slice of every batch."""

    def __init__(self, meeting: Meeting, replica: int, precision: str = "32") -> None:
        super().__init__(device="cpu", precision=precision)
        self.meeting, self._replica = meeting, replica
        self.state: dict[str, Any] = {}

    @property
    def num_replicas_in_sync(self) -> int:
        return REPLICAS

    @property
    def replica_id(self) -> int:
        return self._replica

    def prepare(self, model: torch.nn.Module, optimizer: Any = None) -> Any:
        wrapped, opt = super().prepare(model, optimizer)
        # The anchor is the model as every replica starts it; DiLoCo's first sync moves it.
        self.state["anchor"] = [p.detach().clone() for p in model.parameters()]
        meet = lambda: self.meeting.meet(self._replica, list(model.parameters()), self.state)  # noqa: E731
        return wrapped, MeetingOptimizer(opt, self.meeting.every, meet, self.meeting.epoch)


class MeetingOptimizer(StrategyOptimizer):
    """Calls ``meet`` after every ``every`` real steps (of each epoch of ``epoch`` steps, and at its end, where given)."""

    def __init__(self, opt: StrategyOptimizer, every: int, meet: Callable[[], None], epoch: int | None = None) -> None:
        super().__init__(opt.optimizer, opt.precision, opt._should_step)
        self.meet, self.every, self.epoch, self.steps = meet, every, epoch, 0

    def step(self, closure: Callable | None = None) -> Any:  # type: ignore[override]
        result = super().step(closure)
        if self._should_step(self):
            self.steps += 1
            into = self.steps if self.epoch is None else (self.steps - 1) % self.epoch + 1  # steps into the epoch
            if into % self.every == 0 or into == self.epoch:
                self.meet()
        return result


def simulate(strategy: str, case: str) -> list[dict[str, torch.Tensor]]:
    """Each replica's weights after ``case`` under ``strategy`` (a name in ``LOCAL``)."""
    options = OPTIONS[strategy]
    epoch = cases.STEPS if strategy in EPOCH_ROUNDS else None  # the simulated cases train one epoch
    meeting = Meeting(outer=strategy in OUTER, every=options["sync_every"], late=options.get("overlap_sync", False), epoch=epoch)
    results: list[Any] = [None] * REPLICAS

    def work(replica: int) -> None:
        with meeting.turn:
            try:
                results[replica] = cases.CASES[case](lambda **o: SimulatedReplica(meeting, replica, **o))["weights"]
            except BaseException as error:  # noqa: BLE001 - re-raised below, in the test's thread
                meeting.barrier.abort()
                results[replica] = error

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(REPLICAS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for got in results:
        if not isinstance(got, dict):
            raise AssertionError(f"the simulation of {strategy} on {case} failed: {got!r}")
    return results



def resume(make: Callable[..., loom.Strategy], directory: Path) -> dict[str, Any]:
    """Train, save, go on; a fresh model restored from the save goes on with the same batches.

    Plain SGD keeps no inner state, so the two can differ only by DiLoCo's own state (the outer
    momentum, which the checkpoint must carry).
    """
    strategy = make()
    batches = list(strategy.distribute(cases.data(cases.GLOBAL_BATCH * 6), batch_size=cases.GLOBAL_BATCH, shuffle=False))

    def train(model: torch.nn.Module, opt: Any, few: list[Any]) -> dict[str, torch.Tensor]:
        step = strategy.train_step(model, F.cross_entropy, opt)
        for x, y in few:
            step(x, y)
        strategy.sync()
        return cases.weights(model)

    plain = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    model, opt = strategy.prepare(cases.mlp(), plain)
    train(model, opt, batches[:3])
    strategy.save(directory, step=3, model=model, optimizer=opt)
    went_on = train(model, opt, batches[3:])
    resumed, resumed_opt = strategy.prepare(cases.mlp(), plain)
    strategy.restore(directory, model=resumed, optimizer=resumed_opt)
    return {"went_on": went_on, "resumed": train(resumed, resumed_opt, batches[3:])}
