"""``ClusterCoordinator``: TF's coordinator model on loom's parameter servers, made SPMD (see the class).

The queue and the results live on server 0 (``schedule.py``); a step's pushes carry its
number, so the servers apply them once whoever runs it (``ParameterServer._first_time``).
"""

from __future__ import annotations

import inspect
import os
import threading
from typing import Any, Callable, Iterable, Iterator

import torch

from loom.errors import LoomError
from loom.strategies.parameter_server.client import ServerClient
from loom.strategies.parameter_server.job_failure import JobFailedError, tell_servers
from loom.strategies.parameter_server.schedule import BEAT, POLL
from loom.strategies.parameter_server.strategy import ParameterServerStrategy

RAN_OUT = "its worker's dataset ran out (StopIteration); make the per-worker dataset repeat, as TF's dataset.repeat()"


class RemoteValue:
    """The result of a scheduled function; ``fetch()`` waits for it (TF's ``RemoteValue``)."""

    def __init__(self, coordinator: ClusterCoordinator, number: int) -> None:
        self._coordinator, self.number = coordinator, number

    def fetch(self) -> Any:
        """The function's return value, once some worker has run it (a worker runs steps meanwhile)."""
        return self._coordinator._wait(self.number + 1, want=self.number)

    def __repr__(self) -> str:
        return f"RemoteValue(scheduled function {self.number})"


class PerWorkerIterator:
    """A worker's own iterator over its own dataset; read it inside a scheduled function."""

    def __init__(self, iterator: Iterator[Any] | None) -> None:
        self._iterator = iterator

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            raise LoomError(
                "a per-worker iterator is read on the workers, not on the coordinator: pass it to "
                "coordinator.schedule(fn, args=(iterator,)) and call next() inside fn"
            )
        return next(self._iterator)


class PerWorkerDataset:
    """Each worker's dataset; ``iter()`` gives each worker an iterator over its own."""

    def __init__(self, dataset: Iterable[Any] | None) -> None:
        self._dataset = dataset

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(iter(self._dataset) if self._dataset is not None else None)


class ClusterCoordinator:
    """``tf.distribute.coordinator.ClusterCoordinator`` for ``ParameterServerStrategy``.

    TF ships a function's graph from the coordinator to a worker. A Python function cannot be
    shipped between processes in general (closures, models, iterators), so in loom every
    process runs the same script, as everywhere else in loom:

    - The chief (worker 0; TF_CONFIG's ``chief`` task) is the coordinator: it creates the
      variables (``prepare``), schedules, joins and fetches, and runs no step itself.
    - ``schedule(fn, args=...)`` numbers the function 0, 1, 2... on every process, in the order
      the script schedules them. The coordinator puts each number in a queue on server 0; every
      process keeps its own ``fn`` and ``args`` under that number.
    - A worker runs steps while its script waits in ``join()`` or ``fetch()``: it takes the
      oldest number waiting, runs its own ``fn(*args)`` (so ``args`` are that worker's values,
      its per-worker iterator included) and gives the result to server 0, where every process
      reads it.
    - A step whose worker dies goes back to the front of the queue once the worker's launcher
      has settled its last push, and another worker (or the dead one's successor) runs it. Its
      pushes carry the step's number; the new run sends only those no server applied, and the
      servers apply each once: a worker that died after its update was applied has the step run
      again for its return value only.

    Not as in TF: ``args`` are each process's own (compute them alike on every process); a
    ``RemoteValue`` is refused as an argument; state a function changes on its worker (a metric
    object) stays there, so return what the coordinator needs and fetch it; the schedule lives
    in server 0's memory (a restart of server 0 stops the coordinator, in one line); and the
    steps are asynchronous (``synchronous``/``staleness`` are refused).
    """

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(f"ClusterCoordinator takes a ParameterServerStrategy, not {type(strategy).__name__}")
        if strategy.synchronous or strategy.staleness is not None:
            raise ValueError("ClusterCoordinator runs asynchronous steps, as TF's does: leave out --sync and --staleness")
        if strategy.num_workers < 2:
            raise ValueError(
                "ClusterCoordinator needs a chief that coordinates and at least one worker that runs the steps: "
                "loom run --ps N --workers 2 or more (or TF_CONFIG with a 'chief' and 'worker' tasks)"
            )
        strategy.coordinated = True
        self.strategy = strategy
        self.is_coordinator = strategy.is_chief
        self._functions: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
        self._client = ServerClient(strategy.servers[0], strategy.token)
        self._queue = _Queue(ServerClient(strategy.servers[0], strategy.token)) if self.is_coordinator else None

    def schedule(self, fn: Callable[..., Any], args: Iterable[Any] = (), kwargs: dict[str, Any] | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` for a worker; returns at once with its ``RemoteValue``."""
        args, kwargs = tuple(args), dict(kwargs or {})
        if any(isinstance(a, RemoteValue) for a in (*args, *kwargs.values())):
            raise TypeError("coordinator.schedule takes no RemoteValue arguments in loom: pass value.fetch() instead")
        number = len(self._functions)
        self._functions.append((fn, args, kwargs))
        if self._queue is not None:
            self._queue.add(_name(fn))
        return RemoteValue(self, number)

    def join(self) -> None:
        """Wait until every function scheduled so far has run; the first one's error, if any raised.

        On the coordinator the prepared model then holds the servers' newest values.
        """
        self._wait(len(self._functions))
        if self.is_coordinator:
            self.strategy._pull_latest()

    def done(self) -> bool:
        """Whether every function scheduled so far has run (without waiting for them)."""
        if self._queue is not None:
            self._queue.flush()
        return self._status(len(self._functions), wait=0.0)[0]["left"] == 0

    def fetch(self, values: Any) -> Any:
        """``values`` (a RemoteValue, or lists, tuples and dicts of them) with each RemoteValue fetched."""
        if isinstance(values, RemoteValue):
            return values.fetch()
        if isinstance(values, (list, tuple)):
            return type(values)(self.fetch(v) for v in values)
        if isinstance(values, dict):
            return {k: self.fetch(v) for k, v in values.items()}
        return values

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Iterable[Any]] | Iterable[Any]) -> PerWorkerDataset:
        """Each worker builds its own dataset: ``dataset_fn()``, or ``dataset_fn(ctx)`` with an
        ``InputContext`` (this worker's ``input_pipeline_id`` of the workers that run steps).
        ``strategy.distribute_datasets_from_function`` inside it shards the same way. The
        coordinator builds none."""
        if self.is_coordinator:
            return PerWorkerDataset(None)
        if not callable(dataset_fn):
            return PerWorkerDataset(dataset_fn)
        takes_context = len(inspect.signature(dataset_fn).parameters) > 0
        return PerWorkerDataset(dataset_fn(self.strategy._input_context()) if takes_context else dataset_fn())

    # ---- the loop every process runs while it waits -------------------------------------------------
    def _wait(self, below: int, want: int | None = None) -> Any:
        """Until functions ``0..below-1`` have run (or function ``want`` has: its result); a worker runs steps meanwhile."""
        if self._queue is not None:
            self._queue.flush()
        reply: dict[str, Any] | None = None
        while True:
            if reply is None:
                reply, tensors = self._status(below, POLL, want) if self.is_coordinator else self._take(below, want)
            if "run" in reply:
                reply, tensors = self._run(reply["run"], reply["name"], reply["again"], self._asking(below, want))
                continue
            if reply["error"]:
                raise LoomError(reply["error"])
            if want is not None and str(want) in reply["results"]:
                held = {key.split("/", 2)[2]: value for key, value in tensors.items() if key.startswith(f"r/{want}/")}
                return _unpack(reply["results"][str(want)], held)
            if want is None and reply["left"] == 0:
                return None
            self._check_alive(reply)
            reply = None

    def _status(self, below: int, wait: float, want: int | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        fields = self._request("status", below=below, wait=wait, want=[] if want is None else [want])
        if fields[0]["error"]:
            raise LoomError(fields[0]["error"])
        return fields

    def _take(self, below: int, want: int | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return self._request("take", **self._asking(below, want))

    def _asking(self, below: int, want: int | None) -> dict[str, Any]:
        """What a worker asks server 0 for: the next function it may run, else whether it may stop waiting."""
        return {"worker": self.strategy.worker, "pid": os.getpid(), "below": below, "wait": POLL, "want": [] if want is None else [want]}

    def _check_alive(self, status: dict[str, Any]) -> None:
        """One line instead of a hang: the schedule was lost, no worker is left to run the steps, or
        (on a worker) the coordinator failed or ended without scheduling what this script did."""
        if not self.is_coordinator:
            chief, silent = status["finished"].get("0"), status.get("coordinator_silent")
            if chief is not None and (chief != 0 or status["unknown"]):
                raise LoomError(
                    f"the coordinator (worker 0, the chief) ended (exit code {chief}) with {status['left']} of this "
                    "worker's scheduled functions not run; see the chief's output"
                )
            if status["unknown"] and silent is not None and silent > self.strategy.timeout:
                lost = (f"the coordinator (worker 0, the chief) has not been heard from for {silent:.0f}s, past the job's timeout "
                        f"({self.strategy.timeout:g}s): its process or machine is gone")  # fmt: skip
                # No launcher is left to tell the servers, which would wait for the chief for ever: this worker does,
                # and its launcher, reading a JobFailedError, does not restart it.
                tell_servers(self.strategy.servers, self.strategy.token, None, f"worker {self.strategy.worker} stopped the job: {lost}")
                raise JobFailedError(
                    f"{lost}, with {status['unknown']} of this worker's scheduled functions not yet scheduled "
                    "(--timeout or LOOM_TIMEOUT sets the wait)"
                )
            return
        if status["unknown"]:
            raise LoomError(
                f"parameter server 0 no longer knows {status['unknown']} scheduled functions: it restarted, and the "
                "coordinator's schedule lives in its memory; run the job again (the servers kept the variables)"
            )
        if {str(w) for w in range(1, self.strategy.num_workers)} <= set(status["finished"]):
            raise LoomError(
                f"every worker has ended with {status['left']} scheduled functions not run: each worker's script must "
                "reach the coordinator's join() or fetch() (every process runs the same script)"
            )

    def _run(self, number: int, name: str, again: bool, asking: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Run function ``number`` here and give its result (or its error) to server 0, asking for the
        next one in the same request (``asking``: see ``_take``); server 0's answer. ``again``: a dead
        worker ran it before, so its pushes already applied are not pushed again."""
        fn, args, kwargs = self._functions[number]
        if _name(fn) != name:
            raise LoomError(
                f"the coordinator scheduled {name} as function {number}, this worker's script {_name(fn)}: every process "
                "must run the same script, scheduling the same functions in the same order"
            )
        variables, self.strategy.in_function = self.strategy.variables, True
        if variables is not None and again:
            variables.rerunning(number)
        elif variables is not None:
            variables.closure, variables.closure_pushes, variables.closure_applied = number, 0, set()
        tensors: dict[str, torch.Tensor] = {}
        result, error = None, None
        try:
            result = _pack(fn(*args, **kwargs), tensors)
        except StopIteration:
            error = RAN_OUT
        except Exception as exc:  # given to the coordinator, which raises it, as TF's join does
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self.strategy.in_function = False
            if variables is not None:
                variables.closure = None
        return self._request("done", number=number, result=result, error=error, tensors=tensors, **asking)

    def _request(self, do: str, tensors: dict[str, torch.Tensor] | None = None, **fields: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return self._client.call({"op": "schedule", "do": do, **fields}, tensors)


class _Queue:
    """The coordinator's end of the queue on server 0: a thread of its own sends the functions
    scheduled, all those scheduled since its last request in one, so that ``schedule`` returns at
    once and a loop of schedules costs server 0 a few requests rather than one each; with none to
    send, it beats once a ``BEAT``, so that the workers can tell a lost coordinator from a slow one."""

    def __init__(self, client: ServerClient) -> None:
        self._client = client
        self._changed = threading.Condition()
        self._names: list[str] = []  # every function scheduled, by number
        self._sent = 0
        self._error: Exception | None = None
        threading.Thread(target=self._send, daemon=True, name="loom-coordinator-queue").start()

    def add(self, name: str) -> None:
        with self._changed:
            self._names.append(name)
            self._changed.notify_all()

    def flush(self) -> None:
        """Wait until server 0 has every function scheduled; its error, if it could not take them."""
        with self._changed:
            self._changed.wait_for(lambda: self._sent == len(self._names) or self._error is not None)
            if self._error is not None:
                raise self._error

    def _send(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._sent < len(self._names), BEAT)
                first, names = self._sent, self._names[self._sent :]
            if not names:  # nothing scheduled for a while: say the coordinator is alive
                try:
                    self._client.call({"op": "schedule", "do": "beat"})
                except Exception:  # noqa: BLE001 - a beat is tried again; what is wrong shows at the next add or wait
                    pass
                continue
            try:
                self._client.call({"op": "schedule", "do": "add", "first": first, "names": names})
            except Exception as error:  # raised where the coordinator next waits
                with self._changed:
                    self._error = error
                    self._changed.notify_all()
                return
            with self._changed:
                self._sent = first + len(names)
                self._changed.notify_all()


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _pack(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """A return value as JSON, its tensors put in ``tensors`` (``r/<i>``)."""
    if isinstance(value, torch.Tensor):
        tensors[f"r/{len(tensors)}"] = value.detach().cpu()
        return {"tensor": str(len(tensors) - 1)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__ if type(value) in (list, tuple) else "list": [_pack(v, tensors) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _pack(v, tensors) for k, v in value.items()}}
    raise TypeError(
        f"a scheduled function returns tensors, numbers, strings, None, or lists, tuples and dicts (str keys) of them, "
        f"not {type(value).__name__}"
    )


def _unpack(packed: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if packed is None:
        return None
    kind, inner = next(iter(packed.items()))
    if kind == "tensor":
        return tensors[inner]
    if kind == "value":
        return inner
    if kind == "dict":
        return {k: _unpack(v, tensors) for k, v in inner.items()}
    items = [_unpack(v, tensors) for v in inner]
    return tuple(items) if kind == "tuple" else items
