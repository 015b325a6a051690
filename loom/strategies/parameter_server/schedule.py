"""Server 0's side of ``ClusterCoordinator``: the scheduled functions, who runs each, their results.

The coordinator adds each function it schedules, numbered 0, 1, 2... in the order the script
schedules them; a worker waiting in ``join``/``fetch`` takes the oldest one not yet taken (so a
free worker gets the next step, as in TF), runs it, and gives back its result. A function
whose worker dies is put back at the front of the queue for another worker: when the
worker's launcher says it is done for good (``settle``), or when the worker's successor
asks for work (a new process under the same index). Both come after the launcher has settled
the dead worker's last push, so the push is applied on every server or on none before
anyone runs the function again; the servers apply a function's update once whoever runs it
(``ParameterServer._first_time``). The schedule lives in server 0's memory. The coordinator
asks something at least every ``BEAT`` seconds; a worker waiting for functions it has not
scheduled is told how long it has been silent, and gives up past the job's timeout (the
coordinator's machine is gone, and no launcher is left to say so).
"""

from __future__ import annotations

import heapq
import threading
import time
from typing import Any

import torch

from loom.strategies.parameter_server.wire import WireError

NEEDS = {"add": ("first", "names"), "take": ("worker", "pid", "below"), "done": ("number", "worker"), "status": ("below",), "beat": ()}
BEAT = 1.0  # seconds between the coordinator's requests to server 0 while it schedules nothing: it is alive
NOTHING = {"value": None}  # what a function that returns None gives back: not kept
POLL = 1.0  # seconds a request waits at the server for something to change before it asks again


class Schedule:
    """Each request costs about the same however long the job: numbers are added in order, the
    queue is a heap, and what is done is a count (every number below it) and the few beyond it."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.names: list[str] = []  # function number -> its name, as the coordinator scheduled it
        self.queue: list[int] = []  # waiting for a worker: a heap, oldest first
        self.taken: dict[int, tuple[int, int]] = {}  # number -> (worker index, pid) running it
        self.pids: dict[int, int] = {}  # worker index -> the process that last asked for work
        self.again: set[int] = set()  # given back after its worker died: its pushes may be applied already
        self.done_below = 0  # every function below this number has run
        self.done_beyond: set[int] = set()  # and these, above it
        self.results: dict[int, tuple[Any, dict[str, torch.Tensor]]] = {}  # those that returned something
        self.error: str | None = None  # the first function that raised, and how
        self.heard: float | None = None  # when the coordinator last asked anything (monotonic)

    def handle(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor], finished: dict[str, int]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        do = fields["do"]
        missing = [name for name in NEEDS[do] if name not in fields]
        if missing:
            raise WireError(f"schedule {do}: field '{missing[0]}' is missing")
        with self._changed:
            if do in ("add", "status", "beat"):  # only the coordinator asks these
                self.alive()
            if do == "beat":
                return {}, {}
            if do == "add":
                self._add(fields["first"], fields["names"])
                return {}, {}
            if do == "done":  # with "pid" and "below": and take the next, in the same round trip
                self._done(fields, tensors)
                if "below" not in fields:
                    return {}, {}
                do = "take"
            if do == "take":
                self._arrived(fields["worker"], fields["pid"])
                mine = [n for n, taker in self.taken.items() if taker == (fields["worker"], fields["pid"])]
                if mine:  # the reply that gave it was lost: a worker runs one function at a time
                    return self._give(min(mine))
            self._changed.wait_for(lambda: self._ready(fields, do), min(float(fields.get("wait", 0.0)), POLL))
            if do == "take" and self.error is None and self.queue and self.queue[0] < fields["below"]:
                number = heapq.heappop(self.queue)
                self.taken[number] = (fields["worker"], fields["pid"])
                return self._give(number)
            return self._status(fields, finished)

    def alive(self) -> None:
        """The coordinator (or the chief, creating the variables) was heard from now. A server 0 that
        came back from its files starts the clock too: the chief that made them may be gone."""
        self.heard = time.monotonic()

    def _give(self, number: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return {"run": number, "name": self.names[number], "again": number in self.again}, {}

    def settle(self, finished: set[str]) -> None:
        """Workers done for good: what they were running goes back to the queue."""
        with self._changed:
            self._requeue([n for n, (worker, _) in self.taken.items() if str(worker) in finished])

    def _add(self, first: int, names: list[str]) -> None:
        """Functions ``first``, ``first + 1``...; a restarted coordinator adding them again changes nothing."""
        if first > len(self.names):
            raise WireError(f"schedule add: function {first} after {len(self.names)} functions (numbers come in order)")
        for number in range(len(self.names), first + len(names)):
            self.names.append(names[number - first])
            heapq.heappush(self.queue, number)
        self._changed.notify_all()

    def _arrived(self, worker: int, pid: int) -> None:
        """A worker asks for work: if it is a new process, its predecessor's functions go back to the queue."""
        if self.pids.get(worker, pid) != pid:
            self._requeue([n for n, (w, p) in self.taken.items() if w == worker and p != pid])
        self.pids[worker] = pid

    def _requeue(self, numbers: list[int]) -> None:
        for number in numbers:
            del self.taken[number]
            heapq.heappush(self.queue, number)
            self.again.add(number)
        if numbers:
            self._changed.notify_all()

    def _done(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        number = fields["number"]
        if number >= len(self.names):
            raise WireError(f"schedule done: no function {number} was scheduled")
        self.taken.pop(number, None)
        self.again.discard(number)
        if number in self.queue:  # given back while its worker was thought dead: its result stands
            self.queue.remove(number)
            heapq.heapify(self.queue)
        if self._is_done(number):
            return
        self.done_beyond.add(number)
        while self.done_below in self.done_beyond:
            self.done_beyond.remove(self.done_below)
            self.done_below += 1
        if fields.get("result") not in (None, NOTHING):
            self.results[number] = (fields["result"], {key.split("/", 1)[1]: value for key, value in tensors.items()})
        if fields.get("error") and self.error is None:
            self.error = f"{self.names[number]} (scheduled function {number}) failed on worker {fields['worker']}: {fields['error']}"
        self._changed.notify_all()

    def _is_done(self, number: int) -> bool:
        return number < self.done_below or number in self.done_beyond

    def _ready(self, fields: dict[str, Any], do: str) -> bool:
        below = fields["below"]
        if self.error is not None or any(self._is_done(n) for n in fields.get("want", [])):
            return True
        if do == "take" and self.queue and self.queue[0] < below:
            return True
        return self._left(below) == 0

    def _left(self, below: int) -> int:
        return max(0, below - self.done_below) - sum(1 for n in self.done_beyond if n < below)

    def _status(self, fields: dict[str, Any], finished: dict[str, int]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """How many of functions ``0..below-1`` are not done, the results of those ``want``ed that are, and
        the workers done for good (worker index -> exit code)."""
        below = fields["below"]
        results, tensors = {}, {}
        for number in fields.get("want", []):
            if self._is_done(number):
                results[str(number)], held = self.results.get(number, (NOTHING, {}))
                tensors.update({f"r/{number}/{key}": value for key, value in held.items()})
        silent = None if self.heard is None else time.monotonic() - self.heard
        status = {"left": self._left(below), "unknown": max(0, below - len(self.names)), "results": results, "coordinator_silent": silent}
        return {**status, "error": self.error, "finished": finished, "running": len(self.taken)}, tensors
