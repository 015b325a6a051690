"""What local SGD and DiLoCo should give on the contract's cases, computed without them.

These strategies do not equal one device on the global batch: each replica steps its own
optimizer on its own slice and the replicas meet every H steps. So the contract runs them
with ``OPTIONS`` (H=2 over 3 steps: one sync, then a step apart) and compares every replica
with this simulation: two threads, each a one-device replica on its slice, that take turns
(torch's generator is global, and loom's loaders seed it) and meet at a barrier every H steps and average their parameters (local SGD) or move a shared anchor with
the outer Nesterov SGD written out here by hand (DiLoCo).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

import loom
from loom.strategies.optimizer import StrategyOptimizer
from tests.contract import cases

SYNC_EVERY = 2
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCoStrategy's defaults
OPTIONS: dict[str, dict[str, Any]] = {"local_sgd": {"sync_every": SYNC_EVERY}, "diloco": {"sync_every": SYNC_EVERY}}
LOCAL = tuple(OPTIONS)
SIMULATED = ("sgd_momentum", "adamw_weight_decay", "eager_loop", "bf16_mixed", "fp16_mixed", "accumulate_in_step",
             "accumulate_eager", "clipping", "step_lr")  # fmt: skip
REPLICAS = 2


class Meeting:
    """Where the two replica threads meet every ``SYNC_EVERY`` optimizer steps."""

    def __init__(self, outer: bool) -> None:
        self.outer = outer
        self.barrier = threading.Barrier(REPLICAS, timeout=30)
        self.turn = threading.Lock()  # held by the replica that runs; let go only while waiting at the meeting
        self.posted: list[list[torch.Tensor]] = [[] for _ in range(REPLICAS)]

    @torch.no_grad()
    def meet(self, replica: int, params: list[torch.Tensor], state: dict[str, Any]) -> None:
        self.posted[replica] = [p.detach().clone() for p in params]
        self.turn.release()
        try:
            self.barrier.wait()
            mean = [sum(ts) / REPLICAS for ts in zip(*self.posted)]
            self.barrier.wait()  # both have read before either posts again
        finally:
            self.turn.acquire()
        if self.outer:
            anchor, momentum = state.setdefault("anchor", [p.clone() for p in self.posted[replica]]), state.setdefault("momentum", [])
            pseudo = [a - m for a, m in zip(anchor, mean)]
            if not momentum:
                momentum.extend(g.clone() for g in pseudo)
            else:
                for buf, g in zip(momentum, pseudo):
                    buf.mul_(OUTER_MOMENTUM).add_(g)
            for a, g, buf in zip(anchor, pseudo, momentum):
                a.sub_(OUTER_LR * (g + OUTER_MOMENTUM * buf))  # Nesterov
            mean = anchor
        for p, m in zip(params, mean):
            p.copy_(m)


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
        return wrapped, MeetingOptimizer(opt, lambda: self.meeting.meet(self._replica, list(model.parameters()), self.state))


class MeetingOptimizer(StrategyOptimizer):
    """Calls ``meet`` after every ``SYNC_EVERY`` real steps."""

    def __init__(self, opt: StrategyOptimizer, meet: Callable[[], None]) -> None:
        super().__init__(opt.optimizer, opt.precision, opt._should_step)
        self.meet, self.steps = meet, 0

    def step(self, closure: Callable | None = None) -> Any:  # type: ignore[override]
        result = super().step(closure)
        if self._should_step(self):
            self.steps += 1
            if self.steps % SYNC_EVERY == 0:
                self.meet()
        return result


def simulate(strategy: str, case: str) -> list[dict[str, torch.Tensor]]:
    """Each replica's weights after ``case`` under ``strategy`` (a name in ``LOCAL``)."""
    meeting = Meeting(outer=strategy == "diloco")
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

