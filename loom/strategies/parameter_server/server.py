"""A parameter server: holds its share of the variables, applies pushed gradients, serves pulls.

It is served over gRPC (``service.py``: the job's token, checked before a request is read) and
keeps its state on disk in a snapshot and a write-ahead log (``state_file.py``, ``wal.py``). A push carries the
worker's name and a sequence number, so a retried push is applied once; each push is
applied whole, under the locks of the variables it touches. It is applied in two steps,
staged on every server it touches, then committed: a worker that dies mid-push leaves
staged shares that its launcher commits everywhere or nowhere (``settle.py``). In
synchronous training a push is one worker's share of a round: the server sums the round's
gradients and applies their mean once, when every worker still in the job has given its share.
Server 0 also hosts the workers' reduce/gather/barrier (``collectives.py``), and every server
streams a variable with its optimizer slots in pieces, for checkpoints (``checkpoints.py``).

A server with a state file (``recover``) keeps every update it acknowledges: each change is in
its write-ahead log (``wal.py``) before the reply, and a restart replays the log over the last
snapshot. Workers send the newest ``version`` they have seen with each request; a server that
came back without updates a worker saw (its state files lost or damaged) refuses every request
from then on and reports how many it lost (``lost``), so the job stops instead of going on
without them.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from loom.strategies.parameter_server import chunks, schema, state_file, wal
from loom.strategies.parameter_server.collectives import Meetings
from loom.strategies.parameter_server.job_failure import PREFIX, JobFailedError
from loom.strategies.parameter_server.optimizers import ServerOptimizer
from loom.strategies.parameter_server.rounds import Round
from loom.strategies.parameter_server.schedule import Schedule
from loom.strategies.parameter_server.service import Service
from loom.strategies.parameter_server.state_file import LostUpdatesError, lost_message
from loom.strategies.parameter_server.transport import TLS
from loom.strategies.parameter_server.wire import WireError

LINEAGE_KEPT = 100
CHANGES = frozenset({"create", "commit", "finish", "write", "lineage"})  # requests acknowledged only once their changes are logged
AFTER_FAILURE = frozenset({"fail", "finish", "stats"})  # what a server told that the job failed still answers (job_failure.py)


class ParameterServer:
    """Dense variables and row blocks of embedding tables, with the optimizer that updates them."""

    def __init__(
        self,
        token: str,
        dense: dict[str, torch.Tensor] | None = None,
        tables: dict[str, torch.Tensor] | None = None,
        optimizer: ServerOptimizer | None = None,
    ) -> None:
        """Empty until the chief's ``create`` (or given variables, as a restore does)."""
        self.token = token
        self.dense = dense or {}
        self.tables = tables or {}
        self.optimizer = optimizer or ServerOptimizer()
        self.created = bool(self.dense or self.tables)
        self.applied: dict[str, int] = {}  # worker process -> pushes applied
        self.version = 0  # updates applied here: pushes, or rounds in synchronous training
        self.round = -1  # synchronous training: the last round applied
        self._rounds: dict[int, Round] = {}  # synchronous training: rounds still waiting for workers
        self._round_lock = threading.Lock()
        self._round_done = threading.Condition(self._round_lock)
        self.staleness: dict[int, int] = {}  # pushes applied between a worker's pull and its push -> count
        self.clocks: dict[int, tuple[int, float]] = {}  # worker index -> (steps done, when last heard)
        self.progress: dict[str, int] = {}  # worker index -> steps it has pushed (for the chief's report)
        self.joined: set[str] = set()  # worker indices that pushed in this run of the job
        self.finished: dict[str, int] = {}  # worker index -> exit code, once its launcher says it is done for good
        self._last_seq: dict[str, int] = {}  # worker process -> its last push committed here
        self._staged: dict[tuple[str, int], tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}  # (worker, seq) -> push
        self._locks = {name: threading.Lock() for name in [*self.dense, *self.tables]}
        self._seq_lock = threading.Lock()
        self._service: Service | None = None
        self.meetings = Meetings()  # reduce/gather/barrier over the workers (server 0's)
        self.schedule = Schedule()  # a ClusterCoordinator's functions (server 0's)
        if self.created:  # restored: the chief that created the variables is not known to be alive
            self.schedule.alive()
        self.closures: set[str] = set()  # the scheduled functions' pushes applied in this run (``ClusterCoordinator``)
        self.lineage: list[str] = []  # checkpoints this state was saved to or restored from, newest last
        self.log: wal.WriteAheadLog | None = None  # set by ``recover``: every change is logged before it is acknowledged
        self._log_lock = threading.Lock()  # innermost: orders the log's records
        self.log_from = 0  # the first log generation this state does not hold (from its snapshot)
        self.resumed_at = 0  # the version this server came back at
        self.lost: dict[str, int] | None = None  # a worker saw more than it came back with: {"seen", "resumed_at"}
        self.failed: str | None = None  # told that another task failed the job: which, and why

    # ---- requests ------------------------------------------------------------------------------
    def handle(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Answer one request, checked first (``schema.py``); one that changed the state only once the change is in the log."""
        op = schema.check(fields, tensors)
        self._check_seen(fields.get("seen", -1))
        if self.failed is not None and op not in AFTER_FAILURE:
            raise JobFailedError(PREFIX + self.failed)
        reply = self._handle(fields, tensors)
        if self.log is not None and op in CHANGES:
            self.log.sync()
        return reply

    def _check_seen(self, seen: int) -> None:
        """Refuse every request once a worker has seen a version this server no longer has.

        With a log, the loss is reported in ``FILE.lost`` (JSON) before the first refusal, so
        the launcher knows of it before any worker dies of it.
        """
        with self._seq_lock:
            if seen > self.version and self.lost is None:
                self.lost = {"seen": seen, "resumed_at": self.resumed_at}
                if self.log is not None:
                    report = f"{self.log.snapshot}.lost"
                    Path(f"{report}.tmp").write_text(json.dumps(self.lost))
                    os.replace(f"{report}.tmp", report)
            elif self.lost is not None:
                self.lost["seen"] = max(self.lost["seen"], seen)
            lost = dict(self.lost) if self.lost else None
        if lost:
            raise LostUpdatesError(lost_message(lost))

    def _handle(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        op = fields.get("op")
        if op == "create":
            return {"created": self._create(fields["optimizer"], tensors, fields.get("generate", {}))}, {}
        if op == "ready":
            return {"ready": self.created}, {}
        if op == "pull":  # dense parameters by name, and rows of tables (``ids/<table>``: ids local to this server)
            return {"version": self.version}, self._read_many(fields["names"], tensors)
        if op == "pull_rows":
            return {"version": self.version}, {"rows": self._read_rows(fields["table"], tensors["ids"])}
        if op == "push":
            return {"staged": self._stage(fields, tensors)}, {}
        if op == "commit":  # with "names" or ``ids/<table>`` (as a pull): then read those, in the same round trip
            reply = self._commit(fields["worker"], fields["seq"])
            if reply["missing"] or not (fields.get("names") or tensors):
                return reply, {}
            return {**reply, "version": self.version}, self._read_many(fields.get("names", []), tensors)
        if op == "abort":
            with self._seq_lock:
                self._staged.pop((fields["worker"], fields["seq"]), None)
            return {}, {}
        if op == "pending":
            with self._seq_lock:
                staged = {str(seq): f.get("parts") for (w, seq), (f, _) in self._staged.items() if w == fields["worker"]}
                return {"staged": staged, "committed": self._last_seq.get(fields["worker"], -1)}, {}
        if op == "round":
            return {**self.wait_for_round(fields["round"], fields.get("wait", 0.0)), "version": self.version}, {}
        if op == "tick":
            return self._tick(fields["worker"], fields["clock"], fields["workers"], fields["lease"]), {}
        if op == "finish":
            self._finish(str(fields["worker"]), fields["code"])
            self.meetings.settle(set(self.finished))  # nor does a collective
            self.schedule.settle(set(self.finished))  # and what it was running goes to another worker
            return {}, {}
        if op == "fail":
            self.failed = self.failed or fields["reason"]
            return {}, {}
        if op == "meet":
            if fields.get("next"):
                return {"next": self.meetings.next.get(str(fields["worker"]), 0)}, {}
            return self.meetings.meet(fields, tensors.get("value"), set(self.finished))
        if op == "schedule":
            return self.schedule.handle(fields, tensors, dict(self.finished))
        if op == "read":
            return self._read_chunk(fields["name"], fields["start"], fields["budget"])
        if op == "write":
            self._write_chunk(fields, tensors)
            return {}, {}
        if op == "lineage":  # with "add": record that this state is now that checkpoint's, or descends from it
            return {"lineage": self._add_lineage(fields.get("add"))}, {}
        if op == "closures":  # the pushes of scheduled function ``closure`` applied here
            with self._seq_lock:
                return {"applied": sorted(t for t in self.closures if t.startswith(f"{fields['closure']}."))}, {}
        if op == "stats":
            stats = {"applied": dict(self.applied), "version": self.version, "round": self.round, "staleness": self.staleness}
            return {**stats, "progress": dict(self.progress)}, {}
        raise WireError(f"unknown operation {op!r}")

    def _create(self, optimizer: dict[str, Any], tensors: dict[str, torch.Tensor], generate: dict[str, Any]) -> bool:
        """Take the chief's initial values, once: a chief that restarts finds the trained ones kept.

        Tables in ``generate`` are drawn here, N(0, 1) as ``nn.Embedding`` initializes, so no
        worker ever holds a whole table.
        """
        with self._seq_lock:
            if self.created:
                return False
            rule = ServerOptimizer(**optimizer)  # all made before any is kept: a bad request changes nothing
            dense = {key.split("/", 1)[1]: value.clone() for key, value in tensors.items() if key.startswith("dense/")}
            tables = {key.split("/", 1)[1]: value.clone() for key, value in tensors.items() if key.startswith("table/")}
            for name, spec in generate.items():
                generator = torch.Generator().manual_seed(spec["seed"])
                tables[name] = torch.randn(spec["rows"], spec["dim"], generator=generator)
                if spec.get("padding_row") is not None:  # nn.Embedding(padding_idx=...) starts that row at zero
                    tables[name][spec["padding_row"]] = 0.0
            self.dense.update(dense)
            self.tables.update(tables)
            self._locks.update({name: threading.Lock() for name in [*dense, *tables]})
            self.optimizer = rule
            self.created = True
            self.schedule.alive()  # the chief, which coordinates under ClusterCoordinator (also when the log replays it)
            self._record({"op": "create", "optimizer": optimizer, "generate": generate}, tensors)
            return True

    def _read(self, name: str) -> torch.Tensor:
        with self._locks[name]:
            return self.dense[name].clone()

    def _read_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        if table not in self.tables:
            raise WireError(f"no table '{table}' here")
        with self._locks[table]:  # a copy of the rows
            return self.tables[table].index_select(0, ids)

    def _read_many(self, names: list[str], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Dense parameters ``names``, and for each ``ids/<table>`` those rows as ``rows/<table>``."""
        out = {name: self._read(name) for name in names}
        for key, ids in tensors.items():
            kind, _, table = key.partition("/")
            if kind != "ids":
                raise WireError(f"unknown tensor '{key}' in a read")
            out[f"rows/{table}"] = self._read_rows(table, ids)
        return out

    def _variable(self, name: str) -> torch.Tensor:
        if name not in self._locks:
            raise WireError(f"no variable '{name}' here")
        return self.dense[name] if name in self.dense else self.tables[name]

    def _read_chunk(self, name: str, start: int, budget: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        value = self._variable(name)
        with self._locks[name]:
            return chunks.read(value, self.optimizer.state.get(name, {}), start, budget)

    def _write_chunk(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        value = self._variable(fields["name"])
        with self._locks[fields["name"]]:
            chunks.write(value, self.optimizer.state, fields, tensors)
            self._record({**fields, "op": "write"}, tensors)

    def _tick(self, worker: int, clock: int, workers: int, lease: float) -> dict[str, Any]:
        """Record a worker's progress; report the slowest live worker's (for bounded staleness).

        A worker not yet heard from counts as at step 0 from the first tick on; one not heard
        from for ``lease`` seconds is left out, so a dead or missing one holds no one back.
        """
        now = time.monotonic()
        with self._seq_lock:
            for other in range(workers):
                self.clocks.setdefault(other, (0, now))
            self.clocks[worker] = (clock, now)
            live = [c for c, seen in self.clocks.values() if now - seen <= lease]
        return {"min_clock": min(live)}

    def _stage(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
        """Keep a push, checked, until its commit; a retry, or a push already committed, is ignored."""
        self._check(tensors)
        worker, seq = fields["worker"], fields["seq"]
        with self._seq_lock:
            if seq <= self._last_seq.get(worker, -1) or (worker, seq) in self._staged:
                return False
            self._staged[(worker, seq)] = (fields, tensors)
        return True

    def _commit(self, worker: str, seq: int) -> dict[str, bool]:
        """Apply a staged push. ``missing``: never staged here, or lost with a restart; stage it again."""
        with self._seq_lock:
            staged = self._staged.get((worker, seq))
            done = seq <= self._last_seq.get(worker, -1)
        if staged is None:
            return {"applied": False, "missing": not done}
        return {"applied": self._push(*staged), "missing": False}

    def _push(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
        """Apply one staged push once: a retry of a push already applied is acknowledged and ignored.

        Everything was checked when it was staged, so a bad push changes nothing. With
        ``sync`` (the job's number of workers) the push is worker ``index``'s share of round
        ``seq``, applied with the round. The push, its counts and its log record go together
        (under the locks a snapshot takes): a snapshot has all of them or none.
        """
        worker, seq, index, sync = (fields.get(k) for k in ("worker", "seq", "index", "sync"))
        if sync is None:
            with self._holding(tensors):
                if not self._first_time(worker, seq, fields.get("closure")):
                    return False
                self._step(tensors, fields.get("hyper"))
                self._count(fields, tensors)
            return True
        with self._round_lock:
            if not self._first_time(worker, seq):
                return False
            if seq > self.round:
                for lost in [r for r in self._rounds if r < seq]:  # restarted from an older checkpoint:
                    del self._rounds[lost]  # the workers moved past these rounds, their other shares are gone
                self._rounds.setdefault(seq, Round(sync)).add(str(index), tensors, fields.get("hyper"))
            self._count(fields, tensors)
        self._complete_rounds()
        return True

    def _count(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Count an applied push (a version, in asynchronous training) and log it."""
        worker, seq, index, based_on = (fields.get(k) for k in ("worker", "seq", "index", "based_on"))
        with self._seq_lock:
            self.applied[worker] = self.applied.get(worker, 0) + 1
            if based_on is not None:
                stale = self.version - based_on
                self.staleness[stale] = self.staleness.get(stale, 0) + 1
            if index is not None:  # a worker's sequence numbers count its steps
                self.progress[str(index)] = max(self.progress.get(str(index), 0), seq + 1)
                self.joined.add(str(index))
            if fields.get("sync") is None:
                self.version += 1
            self._record({"op": "commit", "push": fields}, tensors)

    def _first_time(self, worker: str, seq: int, closure: str | None = None) -> bool:
        """A push not applied before; ``closure``: a scheduled function's push, applied once whichever
        worker runs the function (it runs again when its worker died, maybe after this push)."""
        with self._seq_lock:
            self._staged.pop((worker, seq), None)
            if seq <= self._last_seq.get(worker, -1):
                return False
            self._last_seq[worker] = seq
            if closure in self.closures:
                return False
            if closure is not None:
                self.closures.add(closure)
            return True

    @contextlib.contextmanager
    def _holding(self, tensors: dict[str, torch.Tensor]) -> Iterator[None]:
        """The locks of the variables an update touches, in sorted order: no two updates deadlock."""
        held = [self._locks[name] for name in sorted({key.split("/", 1)[1] for key in tensors})]
        for lock in held:
            lock.acquire()
        try:
            yield
        finally:
            for lock in held:
                lock.release()

    def _step(self, tensors: dict[str, torch.Tensor], hyper: list[dict[str, Any]] | None = None) -> None:
        """One update from gradients (``grad/``) and row gradients (``rowids/``, ``rowgrad/``),
        with the parameter groups' hyper-parameters as the worker had them for this step;
        the caller holds the variables' locks."""
        for key, value in tensors.items():
            kind, name = key.split("/", 1)
            if kind == "grad":
                self.optimizer.apply_dense(name, self.dense[name], value, hyper)
            elif kind == "rowgrad":
                self.optimizer.apply_rows(name, self.tables[name], tensors[f"rowids/{name}"], value, hyper)

    def _complete_rounds(self) -> None:
        """Apply each pending round, oldest first, once every worker still in the job has given to it."""
        with self._round_lock:
            while self._rounds:
                round_ = min(self._rounds)
                pending = self._rounds[round_]
                with self._seq_lock:
                    gone = set(self.finished) - pending.workers
                if len(pending.workers) < pending.expected - len(gone):
                    return
                del self._rounds[round_]
                mean = pending.mean()
                with self._holding(mean):
                    self._step(mean, pending.hyper)
                with self._seq_lock:
                    self.version += 1
                    self.round = round_
                self._round_done.notify_all()

    def wait_for_round(self, round_: int, timeout: float) -> dict[str, Any]:
        """Block until ``round_`` is applied or ``timeout`` passes; which workers gave to it so far."""
        with self._round_done:
            self._round_done.wait_for(lambda: self.round >= round_, timeout)
            pending = self._rounds.get(round_)
            return {"round": self.round, "given": sorted(pending.workers) if pending else []}

    def all_finished(self, workers: int) -> bool:
        """Every worker of the job, and any that joined beyond them, is done for good."""
        with self._seq_lock:
            return {str(w) for w in range(workers)} | self.joined <= set(self.finished)

    def new_run(self) -> None:
        """A new run of the job from this state: no worker has joined or finished yet."""
        with self._seq_lock:
            self.joined, self.finished, self.closures = set(), {}, set()
            self._record({"op": "new_run"})

    def _finish(self, worker: str, code: int) -> None:
        with self._seq_lock:
            self.finished[worker] = code
            self._record({"op": "finish", "worker": worker, "code": code})
        self._complete_rounds()  # a synchronous round no longer waits for that worker

    def _add_lineage(self, checkpoint: str | None) -> list[str]:
        with self._seq_lock:
            if checkpoint and checkpoint not in self.lineage:
                self.lineage = [*self.lineage, checkpoint][-LINEAGE_KEPT:]
                self._record({"op": "lineage", "add": checkpoint})
            return list(self.lineage)

    def _record(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Log a change; the caller holds a lock that ``save`` takes too, so a snapshot has the change or the log has it."""
        if self.log is not None:
            with self._log_lock:
                self.log.append(fields, tensors)

    def _replay(self, fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Make a logged change again."""
        op = fields["op"]
        if op == "commit":
            self._push(fields["push"], tensors)
        elif op == "create":
            self._create(fields["optimizer"], tensors, fields["generate"])
        elif op == "write":
            self._write_chunk(fields, tensors)
        elif op == "finish":
            self._finish(fields["worker"], fields["code"])
        elif op == "lineage":
            self._add_lineage(fields["add"])
        elif op == "new_run":
            self.new_run()
        else:
            raise WireError(f"unknown record {op!r} in the log")

    def _check(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, value in tensors.items():
            kind, _, name = key.partition("/")
            if kind == "grad" and (name not in self.dense or value.shape != self.dense[name].shape):
                raise WireError(f"gradient '{name}' {list(value.shape)} matches no variable here")
            if kind == "rowgrad":
                ids = tensors.get(f"rowids/{name}")
                table = self.tables.get(name)
                if table is None or ids is None or value.shape != (len(ids), *table.shape[1:]):
                    raise WireError(f"row gradient '{name}' {list(value.shape)} matches no table rows here")
                if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= len(table)):
                    raise WireError(f"row ids of '{name}' outside this server's {len(table)} rows")
            elif kind not in ("grad", "rowids"):
                raise WireError(f"unknown tensor '{key}' in a push")

    # ---- state files and serving ---------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Everything this server holds, in one safetensors file replaced atomically (``state_file.save``)."""
        state_file.save(self, path)

    @classmethod
    def restore(cls, token: str, path: str | os.PathLike) -> ParameterServer:
        """A server with the state ``save`` wrote (``state_file.restore``)."""
        return state_file.restore(cls, token, path)

    @classmethod
    def recover(cls, token: str, path: str | os.PathLike, durable: bool = True) -> tuple[ParameterServer, str]:
        """The state kept at ``path``, its log replayed, and a line on what came back (``state_file.recover``)."""
        return state_file.recover(cls, token, path, durable)

    def serve(self, port: int, host: str = "127.0.0.1", workers: int | None = None, tls: TLS | None = None) -> int:
        """Start serving on ``host:port`` (loopback unless told otherwise); returns the bound port (``service.py``)."""
        self._service = Service(self.token, self.handle)
        return self._service.start(port, host, workers, tls)

    def stop(self) -> None:
        if self._service is not None:
            self._service.stop()
        if self.log is not None:
            self.log.close()

