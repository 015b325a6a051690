"""reduce, gather and barrier over the workers, met at server 0 (workers share no process group).

Each worker numbers its collectives 0, 1, 2... and gives its value to the one it is at;
server 0 combines them once every worker still in the job has given (a worker whose
launcher said it is done for good is not waited for), and every worker gets the result. A
restarted worker resumes the numbering after the last collective its predecessor gave to.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from loom.errors import LoomError
from loom.strategies.parameter_server.wire import WireError

if TYPE_CHECKING:  # the client imports the server, which imports this
    from loom.strategies.parameter_server.client import ServerClient

OPS = ("sum", "mean", "max", "min", "product", "gather")
RESULTS_KEPT = 64  # combined results kept for workers that have not fetched theirs yet
POLL = 1.0  # seconds a call waits at the server before the worker asks again


def combine(op: str, values: list[torch.Tensor]) -> torch.Tensor:
    """``values`` in worker order, combined by ``op``."""
    if op == "gather":
        return torch.cat(values)
    if any(v.shape != values[0].shape for v in values):
        raise WireError(f"workers gave {op} tensors of different shapes: {[list(v.shape) for v in values]}")
    stacked = torch.stack(values)
    if op == "sum":
        return stacked.sum(0)
    if op == "mean":
        return stacked.sum(0) / len(values)
    if op == "product":
        return stacked.prod(0)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


class Meetings:
    """Server 0's side: what each worker gave to each numbered collective, and the results."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._given: dict[int, dict[str, torch.Tensor]] = {}  # number -> worker -> value
        self._spec: dict[int, tuple[str, int]] = {}  # number -> (op, workers in the job)
        self._results: dict[int, torch.Tensor] = {}
        self.next: dict[str, int] = {}  # worker -> the number after the last it gave to

    def meet(
        self, fields: dict[str, Any], value: torch.Tensor | None, finished: set[str]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Take a worker's value (once), then wait up to ``wait`` seconds for the result."""
        number, worker = fields["number"], str(fields["worker"])
        with self._changed:
            if number not in self._results and value is not None and worker not in self._given.get(number, {}):
                if fields["reduce"] not in OPS:
                    raise WireError(f"unknown collective {fields['reduce']!r}")
                self._given.setdefault(number, {})[worker] = value
                self._spec[number] = (fields["reduce"], fields["workers"])
                self.next[worker] = max(self.next.get(worker, 0), number + 1)
                self._complete(finished)
            self._changed.wait_for(lambda: number in self._results, min(float(fields.get("wait", 0.0)), POLL))
            if number in self._results:
                return {"done": True}, {"result": self._results[number]}
            given = self._given.get(number, {})
            missing = [w for w in range(fields["workers"]) if str(w) not in given and str(w) not in finished]
            return {"done": False, "have": worker in given, "missing": missing}, {}

    def settle(self, finished: set[str]) -> None:
        """A worker is done for good: collectives waiting only for it complete without it."""
        with self._changed:
            self._complete(finished)

    def _complete(self, finished: set[str]) -> None:
        for number in sorted(self._given):
            given = self._given[number]
            op, workers = self._spec[number]
            if any(str(w) not in given and str(w) not in finished for w in range(workers)):
                continue
            del self._given[number], self._spec[number]
            self._results[number] = combine(op, [given[w] for w in sorted(given, key=int)])
            for old in sorted(self._results)[:-RESULTS_KEPT]:
                del self._results[old]
            self._changed.notify_all()


class Collectives:
    """A worker's side: give a value to the next collective and wait for every worker's."""

    def __init__(self, client: ServerClient, worker: int, workers: int, timeout: float) -> None:
        self.client = client
        self.worker = worker
        self.workers = workers
        self.timeout = timeout
        self.number: int | None = None  # the next collective; asked from server 0 at the first one

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """A ``loom.strategies.cross_replica.Transport``: ``reduce`` over the workers."""
        return self.run(op, tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.run("gather", tensor)

    def run(self, op: str, value: torch.Tensor) -> torch.Tensor:
        if self.number is None:
            self.number = self.client.call({"op": "meet", "next": True, "worker": self.worker})[0]["next"]
        number, self.number = self.number, self.number + 1
        fields = {"op": "meet", "number": number, "worker": self.worker, "workers": self.workers, "reduce": op, "wait": POLL}
        give_up, have = time.monotonic() + self.timeout, False
        while True:
            reply, tensors = self.client.call(fields, None if have else {"value": value.detach().cpu()})
            if reply["done"]:
                return tensors["result"].to(value.device)
            have = reply["have"]  # False after server 0 restarted and lost it: give it again
            if time.monotonic() > give_up:
                raise LoomError(
                    f"{op} #{number} over the parameter-server workers: worker(s) {reply['missing']} did not get there "
                    f"within {self.timeout:g}s; every worker must call it the same number of times (raise the timeout "
                    "with LOOM_TIMEOUT if they are just slow)"
                )
