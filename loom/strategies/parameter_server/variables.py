"""A worker's view of the variables spread over the servers: create, pull, push.

Pulls and pushes go to the servers at once (every request sent, then every reply read), each server
getting only its share: its dense parameters, and for a table the rows in its range. A push
is staged on every server it touches before any applies it (then committed), so a worker
that dies mid-push leaves nothing half-applied that its launcher cannot settle. Every request
carries the newest version the worker has seen from that server (``seen``): a server that
restarted without updates the worker saw refuses it, instead of training on without them.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from loom.strategies.parameter_server.client import ServerClient
from loom.strategies.parameter_server.partitioner import Placement


def worker_name(index: int, pid: int) -> str:
    """One name per worker process: a restarted worker's pushes start again at sequence 0."""
    return f"worker-{index}.{pid}"


class ShardedVariables:
    def __init__(self, clients: list[ServerClient], placement: Placement, worker: str, index: int = 0) -> None:
        self.clients = clients
        self.placement = placement
        self.worker = worker
        self.index = index
        self.clock = 0  # steps pushed; also the sequence number of the next push
        self.versions: dict[int, int] = {}  # server -> its version when this worker last pulled from it
        self.seen: dict[int, int] = {}  # server -> the newest version this worker has seen there
        self._splits: deque[tuple[str, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = deque(maxlen=4)
        self._last_push: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}  # server -> request
        self.closure: int | None = None  # the scheduled function running (``ClusterCoordinator``): its pushes are tagged
        self.closure_pushes = 0  # pushes in it so far
        self.closure_applied: set[str] = set()  # its pushes a dead worker's run of it applied: not pushed again

    def _fan_out(self, requests: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]]) -> dict[int, tuple[dict, dict]]:
        sent = {s: self.clients[s].send({**fields, "seen": self.seen.get(s, -1)}, tensors) for s, (fields, tensors) in requests.items()}
        replies = {s: reply.result() for s, reply in sent.items()}  # all sent at once, then every reply read
        for s, (fields, _) in replies.items():
            if "version" in fields:
                self._saw(s, fields["version"])
        return replies

    def _call(self, server: int, fields: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> tuple[dict, dict]:
        """One request to one server, carrying what this worker has seen there."""
        reply = self.clients[server].call({**fields, "seen": self.seen.get(server, -1)}, tensors)
        if "version" in reply[0]:
            self._saw(server, reply[0]["version"])
        return reply

    def _saw(self, server: int, version: int) -> None:
        self.versions[server] = version
        self.seen[server] = max(self.seen.get(server, -1), version)

    def _split(self, table: str, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``placement.rows_by_server``, kept for the last few id tensors: a step reads the next
        batch's rows, places them, then pushes their gradients, all with the same ids."""
        for name, known, parts in self._splits:
            if known is ids and name == table:
                return parts
        parts = self.placement.rows_by_server(table, ids)
        self._splits.append((table, ids, parts))
        return parts

    @property
    def bytes_moved(self) -> int:
        """Bytes this worker sent and received, counted at the transport."""
        return sum(c.bytes_sent + c.bytes_received for c in self.clients)

    def create(
        self,
        dense: dict[str, torch.Tensor],
        tables: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        generated: dict[str, tuple[int, int, int | None]] | None = None,
    ) -> None:
        """The chief's first act: every server gets its variables' initial values and the update rule.

        ``generated`` tables (name -> (dim, seed, padding_idx)) are not sent: each server draws
        its rows itself.
        """
        requests = {}
        for s in range(len(self.clients)):
            tensors = {f"dense/{n}": t for n, t in dense.items() if self.placement.dense[n] == s}
            for name, table in tables.items():
                lo, hi = self.placement.row_bounds[name][s : s + 2]
                tensors[f"table/{name}"] = table[lo:hi]
            draws = {}
            for name, (dim, seed, padding) in (generated or {}).items():
                lo, hi = self.placement.row_bounds[name][s : s + 2]
                draws[name] = {"rows": hi - lo, "dim": dim, "seed": seed * 1_000 + s}
                if padding is not None and lo <= padding < hi:
                    draws[name]["padding_row"] = padding - lo
            requests[s] = ({"op": "create", "optimizer": optimizer, "generate": draws}, tensors)
        self._fan_out(requests)

    def _by_server(self, names: list[str]) -> dict[int, list[str]]:
        grouped: dict[int, list[str]] = {}
        for name in names:
            grouped.setdefault(self.placement.dense[name], []).append(name)
        return grouped

    def pull_dense(self, names: list[str]) -> dict[str, torch.Tensor]:
        return self.pull(names, {})[0]

    def pull(self, names: list[str], rows: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Dense parameters ``names`` and, in the same round trip, rows ``rows[table]`` (ids unique) of tables."""
        reads = self._reads(names, rows)
        replies = self._fan_out({s: ({"op": "pull", "names": held}, ids) for s, (held, ids) in reads.items()})
        return self._gather({s: tensors for s, (_, tensors) in replies.items()}, rows)

    def _reads(self, names: list[str], rows: dict[str, torch.Tensor]) -> dict[int, tuple[list[str], dict[str, torch.Tensor]]]:
        """server -> (its dense names, its ``ids/<table>`` local row ids): what to read from each."""
        reads: dict[int, tuple[list[str], dict[str, torch.Tensor]]] = {}
        for server, held in self._by_server(names).items():
            reads.setdefault(server, ([], {}))[0].extend(held)
        for table, ids in rows.items():
            for server, (_, local) in enumerate(self._split(table, ids)):
                if len(local):
                    reads.setdefault(server, ([], {}))[1][f"ids/{table}"] = local
        return reads

    def _gather(self, replies: dict[int, dict[str, torch.Tensor]], rows: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        """The dense parameters and each table's rows (in the order asked) from the servers' replies."""
        dense = {name: value for tensors in replies.values() for name, value in tensors.items() if not name.startswith("rows/")}
        tables = {}
        for table, ids in rows.items():
            parts = self._split(table, ids)
            first = next((t[f"rows/{table}"] for t in replies.values() if f"rows/{table}" in t), None)
            if first is None:  # no ids asked for
                continue
            out = torch.empty(len(ids), *first.shape[1:], dtype=first.dtype)
            for s, (positions, _) in enumerate(parts):
                if len(positions):
                    out.index_copy_(0, positions, replies[s][f"rows/{table}"])
            tables[table] = out
        return dense, tables

    def pull_rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of ``table`` (ids unique), each from the server holding it."""
        parts = self._split(table, ids)
        requests = {s: ({"op": "pull_rows", "table": table}, {"ids": local}) for s, (_, local) in enumerate(parts) if len(local)}
        replies = self._fan_out(requests or {0: ({"op": "pull_rows", "table": table}, {"ids": ids})})  # no ids: asked for the row shape
        first = next(iter(replies.values()))[1]["rows"]
        rows = torch.empty(len(ids), *first.shape[1:], dtype=first.dtype)
        for s, (positions, _) in enumerate(parts):
            if s in replies:
                rows.index_copy_(0, positions, replies[s][1]["rows"])
        return rows

    def push(
        self,
        dense_grads: dict[str, torch.Tensor],
        row_grads: dict[str, tuple[torch.Tensor, torch.Tensor]],
        sync: int | None = None,
        then_pull: list[str] | None = None,
        hyper: list[dict[str, Any]] | None = None,
        every_shard: bool = False,
        then_rows: dict[str, torch.Tensor] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One step's gradients: each server gets its share, tagged so that a retry applies once;
        staged everywhere first, then committed everywhere. ``then_pull`` (dense parameters) and
        ``then_rows`` (table -> unique row ids): what to read once the push is applied, in the
        commit's round trip (returned, as ``pull`` returns them). ``hyper``:
        each parameter group's hyper-parameters for this step (what the scheduler set).
        ``every_shard``: every server holding rows of a pushed table gets its share, even with
        no rows in it, so that its rows untouched this step are stepped too (exact semantics).

        With ``sync`` (the number of workers) the push is this worker's share of round
        ``clock``, and every server gets one, even an empty one, so that it can count the round.
        """
        tag = None if self.closure is None else f"{self.closure}.{self.closure_pushes}"
        if tag is not None:
            self.closure_pushes += 1
            if tag in self.closure_applied:  # an earlier run of this function applied it: read what it would have
                return self.pull(then_pull or [], then_rows or {})
        requests: dict[int, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}

        def share(server: int) -> dict[str, torch.Tensor]:
            if server not in requests:
                fields = {"op": "push", "worker": self.worker, "index": self.index, "seq": self.clock, "sync": sync, "hyper": hyper}
                requests[server] = ({**fields, "based_on": self.versions.get(server)}, {})
                if tag is not None:  # applied once, whichever worker runs the function
                    requests[server][0]["closure"] = tag
            return requests[server][1]

        if sync is not None:
            for server in range(len(self.clients)):
                share(server)

        for name, grad in dense_grads.items():
            share(self.placement.dense[name])[f"grad/{name}"] = grad
        for name, (ids, grads) in row_grads.items():
            for s, (positions, local) in enumerate(self._split(name, ids)):
                if len(local) or every_shard:
                    share(s)[f"rowids/{name}"] = local
                    share(s)[f"rowgrad/{name}"] = grads.index_select(0, positions)
        parts = sorted(requests)
        for fields, _ in requests.values():
            fields["parts"] = parts  # so that a dead worker's launcher can tell a whole push from a half one
        self._fan_out(requests)
        self._last_push = requests
        rows = then_rows or {}
        replies = self._commit(parts, self._reads(then_pull or [], rows))
        self.clock += 1
        return self._gather(replies, rows)

    def _commit(self, servers: list[int], reads: dict[int, tuple[list[str], dict[str, torch.Tensor]]]) -> dict[int, dict[str, torch.Tensor]]:
        """Apply the staged push on ``servers`` and do ``reads`` (see ``_reads``) after it; each
        server's reply tensors. A server that lost the push (restarted) gets it again."""
        commit = {"op": "commit", "worker": self.worker, "seq": self.clock}
        nothing: tuple[list[str], dict[str, torch.Tensor]] = ([], {})
        requests = {s: ({**commit, "names": reads.get(s, nothing)[0]}, reads.get(s, nothing)[1]) for s in servers}
        requests.update({s: ({"op": "pull", "names": names}, ids) for s, (names, ids) in reads.items() if s not in requests})
        replies = {}
        for server, (fields, tensors) in self._fan_out(requests).items():
            if fields.get("missing"):
                self._deliver(server, commit)
                names, ids = reads.get(server, nothing)
                tensors = self._call(server, {"op": "pull", "names": names}, ids)[1] if names or ids else {}
            replies[server] = tensors
        return replies

    def _deliver(self, server: int, commit: dict[str, Any]) -> None:
        self._call(server, *self._last_push[server])
        self._call(server, commit)

    def rerunning(self, closure: int) -> None:
        """Run scheduled function ``closure`` again (its worker died): its pushes that any server
        applied (the launcher applied a dead worker's push on every server it was for, or on none)
        are not pushed again; the others are."""
        self.closure, self.closure_pushes = closure, 0
        self.closure_applied = {t for s in range(len(self.clients)) for t in self._call(s, {"op": "closures", "closure": closure})[0]["applied"]}

    def join_rounds(self) -> None:
        """Synchronous training: start at the oldest round a server still waits for.

        A round a dead predecessor gave to (its launcher settled that share on every server)
        is given again and ignored; one it did not give to is given now.
        """
        self.clock = min(self._call(s, {"op": "round", "round": -1})[0]["round"] for s in range(len(self.clients))) + 1

    def wait_for_round(self) -> None:
        """Block until every server has applied the round this worker just pushed to.

        A server restarted from a checkpoint older than this worker's share no longer has it;
        it is sent again (same sequence number, so never counted twice).
        """
        round_ = self.clock - 1
        for server in range(len(self.clients)):
            while True:
                fields, _ = self._call(server, {"op": "round", "round": round_, "wait": 1.0})
                if fields["round"] >= round_:
                    break
                if str(self.index) not in fields["given"]:
                    self._deliver(server, {"op": "commit", "worker": self.worker, "seq": round_})

    def wait_for_peers(self, workers: int, staleness: int, lease: float = 30.0) -> None:
        """Block while this worker is more than ``staleness`` steps ahead of the slowest live one."""
        while True:
            request = {"op": "tick", "worker": self.index, "clock": self.clock, "workers": workers, "lease": lease}
            fields, _ = self.clients[0].call(request)
            if self.clock - fields["min_clock"] <= staleness:
                return
            time.sleep(0.005)

    def close(self) -> None:
        for client in self.clients:
            client.close()
