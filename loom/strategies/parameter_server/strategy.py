"""ParameterServerStrategy: asynchronous data parallelism with variables on parameter servers.

Each worker runs the user's usual loop. ``prepare`` swaps embedding tables for remote ones
and has the chief create every variable on the servers; a forward pass pulls only the rows
its batch touches; ``optimizer.step()`` pushes the gradients (rows only, for tables) and
pulls the latest dense parameters. Workers never wait for each other (unless ``staleness``
bounds how far apart they may get): a slow or lost worker does not hold the rest back.
``reduce``/``gather``/``barrier`` meet at server 0, so metrics cover every worker; ``save``
and ``restore`` move the servers' values and optimizer slots as an ordinary checkpoint.
``loom run --ps`` (one machine) or ``--ps-hosts``/TF_CONFIG (across machines) starts the
servers and sets the variables this strategy reads.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from loom.comm import preemption
from loom.errors import LoomError
from loom.strategies.base import Number, OptimizerFactory, Strategy, unwrap
from loom.strategies.parameter_server.checkpoints import mirror, plain_state, pull_all, write_back
from loom.strategies.parameter_server.client import ServerClient
from loom.strategies.parameter_server.collectives import Collectives
from loom.strategies.parameter_server.partitioner import place
from loom.strategies.parameter_server.variables import ShardedVariables, worker_name

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
RATE_WINDOW = 10.0  # seconds the job report's rates are taken over
CHECKPOINT_ID = "parameter_server_checkpoint"  # a saved value naming the checkpoint, for the servers' lineage


class RemoteEmbedding(nn.Module):
    """An embedding table that lives on the servers; forward pulls only the rows it needs."""

    def __init__(self, name: str, local: nn.Embedding | nn.EmbeddingBag, variables: ShardedVariables) -> None:
        super().__init__()
        self.name = name
        self.bag = isinstance(local, nn.EmbeddingBag)
        self.mode = getattr(local, "mode", None)
        self.variables = variables  # not a submodule: a copy of the model shares it
        self.touched: list[tuple[torch.Tensor, torch.Tensor]] = []  # (row ids, pulled rows) of this step

    def local_like(self, weight: torch.Tensor) -> nn.Module:
        """The plain module this one replaced, holding ``weight`` (for a checkpoint)."""
        if self.bag:
            return nn.EmbeddingBag.from_pretrained(weight, freeze=False, mode=self.mode)
        return nn.Embedding.from_pretrained(weight, freeze=False)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        unique, local_ids = torch.unique(ids, return_inverse=True)
        rows = self.variables.pull_rows(self.name, unique)
        if torch.is_grad_enabled():  # kept for the push; evaluation keeps nothing
            self.touched.append((unique, rows.requires_grad_()))
        if self.bag:
            return F.embedding_bag(local_ids, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights)
        return F.embedding(local_ids, rows)

    def row_gradients(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's row ids and their gradients, summed over forward passes."""
        parts = [(ids, rows.grad) for ids, rows in self.touched if rows.grad is not None]
        self.touched = []
        if not parts:
            return None
        return torch.cat([ids for ids, _ in parts]), torch.cat([g for _, g in parts])


class ParameterServerOptimizer(torch.optim.Optimizer):
    """``step()`` pushes this worker's gradients and pulls the newest dense parameters.

    The rule (SGD, momentum, Adagrad, Adam) runs on the servers, taken from the optimizer the
    user built, so the training loop does not change.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        model: nn.Module,
        variables: ShardedVariables,
        workers: int,
        staleness: int | None,
        synchronous: bool = False,
    ) -> None:
        self.optimizer = inner
        self.model = model
        self.variables = variables
        self.workers = workers
        self.staleness = staleness
        self.synchronous = synchronous
        self.dense = {n: p for n, p in model.named_parameters()}
        self.remote = {m.name: m for m in model.modules() if isinstance(m, RemoteEmbedding)}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's: its state is the servers' as of the last ``restore`` (they keep the live one)."""
        return self.optimizer.state_dict()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        dense = {n: p.grad for n, p in self.dense.items() if p.grad is not None}
        rows = {name: g for name, m in self.remote.items() if (g := m.row_gradients()) is not None}
        if self.synchronous or self.staleness is not None:
            self.variables.push(dense, rows, sync=self.workers if self.synchronous else None)
            if self.synchronous:
                self.variables.wait_for_round()
            else:
                self.variables.wait_for_peers(self.workers, self.staleness)
            pulled = self.variables.pull_dense(list(self.dense))
        else:  # asynchronous: the newest parameters come back with the commit
            pulled = self.variables.push(dense, rows, then_pull=list(self.dense))
        for name, value in pulled.items():
            self.dense[name].copy_(value)


class ParameterServerStrategy(Strategy):
    """Workers that train on their own data and meet only at the parameter servers."""

    def __init__(
        self,
        servers: Sequence[str] | None = None,
        token: str | None = None,
        worker: int | None = None,
        num_workers: int | None = None,
        staleness: int | None = None,
        synchronous: bool | None = None,
        precision: str = "32",
        timeout: float | None = None,
    ) -> None:
        """``staleness``: None for fully asynchronous workers; K to keep every worker within K
        steps of the slowest live one; 0 for lockstep (each step sees every worker's last one,
        each worker's gradient applied on its own). ``synchronous``: each step the servers apply
        the mean of every worker's gradients once, so N workers train as one on the global batch."""
        super().__init__(precision, timeout)
        servers = servers or [a for a in os.environ.get("LOOM_PS_SERVERS", "").split(",") if a]
        if not servers:
            raise ValueError("ParameterServerStrategy needs the servers' addresses: servers=[...] or LOOM_PS_SERVERS")
        self.servers = list(servers)
        self.token = token or os.environ.get("LOOM_PS_TOKEN", "")
        self.worker = int(os.environ.get("LOOM_PS_WORKER", "0")) if worker is None else worker
        self.num_workers = int(os.environ.get("LOOM_PS_WORKERS", "1")) if num_workers is None else num_workers
        env_staleness = os.environ.get("LOOM_PS_STALENESS")
        self.staleness = staleness if staleness is not None else (int(env_staleness) if env_staleness else None)
        if self.staleness is not None and self.staleness < 0:
            raise ValueError(f"staleness must be None (asynchronous) or a number of steps >= 0, got {self.staleness}")
        self.synchronous = os.environ.get("LOOM_PS_SYNC") == "1" if synchronous is None else synchronous
        if self.synchronous and self.staleness is not None:
            raise ValueError("synchronous training has no staleness: pass one of staleness=K and synchronous=True")
        self.variables: ShardedVariables | None = None
        self.rate_window = RATE_WINDOW
        self._samples: deque[tuple[float, dict[str, int]]] = deque([(time.monotonic(), {})])  # (when, steps per worker)

    @property
    def num_replicas_in_sync(self) -> int:
        return self.num_workers  # workers split the data; their updates are not in sync

    @property
    def replica_id(self) -> int:
        return self.worker

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def step(self) -> int:
        """Steps this worker has pushed, its predecessors' included, so a restarted worker resumes
        its loop there; in synchronous training the job's round (all workers run the same steps)."""
        return self.variables.clock if self.variables is not None else 0

    def scope(self) -> Any:
        """Build the model inside ``with strategy.scope():`` so that no worker allocates the tables.

        Parameters are created on the meta device; ``prepare`` then has the servers create the
        embedding rows (N(0, 1), ``nn.Embedding``'s own initialization, each server its range)
        and gives the other layers real memory, initialized by their ``reset_parameters``.
        """
        return torch.device("meta")

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
        tables = {n: m for n, m in model.named_modules() if isinstance(m, EMBEDDINGS)}
        table_params = {f"{n}.weight" for n in tables}
        shapes = {n: p for n, p in model.named_parameters() if n not in table_params}
        placement = place(
            {n: p.numel() * p.element_size() for n, p in shapes.items()},
            {n: (m.num_embeddings, m.embedding_dim * m.weight.element_size()) for n, m in tables.items()},
            len(self.servers),
        )
        clients = [ServerClient(a, self.token) for a in self.servers]
        self.variables = ShardedVariables(clients, placement, worker_name(self.worker, os.getpid()), self.worker)
        initial = {n: m.weight.detach() for n, m in tables.items()}
        for name, module in tables.items():
            _replace(model, name, RemoteEmbedding(name, module, self.variables))
        _materialize(model)  # built under scope(): the dense layers get memory now, the tables never
        inner = optimizer if isinstance(optimizer, torch.optim.Optimizer) else optimizer(model.parameters())
        if self.is_chief:
            dense = {n: p.detach() for n, p in model.named_parameters()}
            self.variables.create(dense, {n: t for n, t in initial.items() if not t.is_meta}, server_rule(inner),
                                  {n: (t.shape[1], self.worker) for n, t in initial.items() if t.is_meta})  # fmt: skip
        else:
            self._wait_until_created(clients)
        if self.synchronous:
            self.variables.join_rounds()
        else:  # a restarted worker goes on from its predecessor's steps, not from 0 (staleness counts them)
            self.variables.clock = max(int(c.call({"op": "stats"})[0]["progress"].get(str(self.worker), 0)) for c in clients)
        opt = ParameterServerOptimizer(inner, model, self.variables, self.num_workers, self.staleness, self.synchronous)
        for name, value in self.variables.pull_dense(list(opt.dense)).items():
            opt.dense[name].data.copy_(value)
        return model, opt

    def save(self, directory: str | Path, **options: Any) -> Path | None:  # type: ignore[override]
        """The chief saves an ordinary loom checkpoint; other workers return None.

        Each model is saved as the user built it, tables included, with the servers' values;
        each optimizer as a torch optimizer of the user's class holding the servers' slots
        (keyed as torch keeps them). So it restores under any strategy. Options (``step``,
        ``keep``...) are the base class's. Variables are read in pieces, so no table is too large.
        """
        if not self.is_chief:
            return None
        variables = self._prepared()
        state = plain_state(variables, options, pull_all(variables))
        state[CHECKPOINT_ID] = uuid.uuid4().hex
        path = super().save(directory, **state)
        for client in variables.clients:  # the servers' state now descends from that checkpoint
            client.call({"op": "lineage", "add": state[CHECKPOINT_ID]})
        return path

    def restore(self, directory: str | Path, **options: Any) -> dict[str, Any] | None:  # type: ignore[override]
        """Load a checkpoint of any strategy; the chief writes its values (and, with an
        optimizer, its slots) to the servers, and every worker then pulls them.

        A checkpoint the servers' state descends from (saved during this job, which went on
        training since) is not written back: a restarted worker resumes from the servers' newer
        state, and only its own values (the loader's position, the epoch) come from the checkpoint.
        """
        variables = self._prepared()
        state = plain_state(variables, options, None)
        saved = super().restore(directory, **state)
        if saved is None:
            return None
        checkpoint = saved.pop(CHECKPOINT_ID, None) or str(saved["path"])
        if not all(checkpoint in c.call({"op": "lineage"})[0]["lineage"] for c in variables.clients):
            if self.is_chief:
                write_back(variables, state, options)
                for client in variables.clients:
                    client.call({"op": "lineage", "add": checkpoint})
            else:
                self._wait_for_lineage(checkpoint)
            mirror(variables, state, options)
        pulled = variables.pull_dense(list(variables.placement.dense))
        for value in options.values():
            if isinstance(value, nn.Module):
                with torch.no_grad():
                    for name, parameter in unwrap(value).named_parameters():
                        if name in pulled:
                            parameter.copy_(pulled[name])
        return saved

    def _consolidated(self, model: nn.Module) -> nn.Module:
        """A plain copy of ``model`` holding the servers' values, tables in place (what ``save`` writes)."""
        variables = self._prepared()
        return plain_state(variables, {"model": model}, pull_all(variables))["model"]

    def _prepared(self) -> ShardedVariables:
        if self.variables is None:
            raise LoomError("prepare(model, optimizer) first: the variables live on the servers once prepared")
        return self.variables

    def _wait_for_lineage(self, checkpoint: str) -> None:
        """A worker other than the chief waits for the chief to write a restored checkpoint to the servers."""
        variables = self._prepared()
        give_up = time.monotonic() + self.timeout
        while not all(checkpoint in c.call({"op": "lineage"})[0]["lineage"] for c in variables.clients):
            if time.monotonic() > give_up:
                raise LoomError(
                    f"restore: the chief did not write checkpoint {checkpoint} to the servers within {self.timeout:g}s; "
                    "every worker restores the same checkpoint (the chief too), from the same path"
                )
            time.sleep(0.1)

    def _wait_until_created(self, clients: Iterable[ServerClient]) -> None:
        for client in clients:
            while not client.call({"op": "ready"})[0]["ready"]:
                time.sleep(0.1)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def job_report(self) -> dict[str, float]:
        """The job as the servers see it: global step, updates/s, staleness, each worker's steps/s.

        Rates are over the last ``rate_window`` seconds (since the start, early on), the same
        whoever asks: the progress bar and TensorBoard do not reset each other's.
        """
        assert self.variables is not None
        stats = [c.call({"op": "stats"})[0] for c in self.variables.clients]
        progress: dict[str, int] = {}
        staleness: dict[int, int] = {}
        for server in stats:
            for worker, step in server["progress"].items():
                progress[worker] = max(progress.get(worker, 0), step)
            for stale, count in server["staleness"].items():
                staleness[int(stale)] = staleness.get(int(stale), 0) + count
        now, global_step = time.monotonic(), sum(progress.values())
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.rate_window:
            self._samples.popleft()  # the base: the newest sample at least a window old
        since, before = self._samples[0]
        self._samples.append((now, progress))
        elapsed = max(now - since, 1e-9)
        report = {"global_step": float(global_step), "updates_per_sec": (global_step - sum(before.values())) / elapsed}
        report.update(_percentiles(staleness))
        for worker, step in sorted(progress.items()):
            report[f"worker{worker}_steps_per_sec"] = (step - before.get(worker, 0)) / elapsed
        return report

    def reduce(self, value: torch.Tensor | Number, op: str = "mean") -> torch.Tensor | Number:
        """Combine a tensor or a number over every worker still in the job, met at server 0."""
        if op not in ("sum", "mean", "max", "min", "product"):
            raise ValueError(f"unknown reduce op {op!r}; use one of sum, mean, max, min, product")
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            tensor = tensor.double() if op == "mean" and not tensor.is_floating_point() else tensor
        elif isinstance(value, (int, float)):
            tensor = torch.tensor(float(value), dtype=torch.float64)
        else:
            raise TypeError(f"reduce() takes a tensor or a number, not {type(value).__name__}")
        result = self._collectives().run(op, tensor)
        if isinstance(value, torch.Tensor):
            return result.to(tensor.dtype)
        return int(result.item()) if isinstance(value, int) and op != "mean" else result.item()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every worker's ``tensor`` concatenated along dim 0 in worker order (sizes may differ)."""
        return self._collectives().run("gather", tensor.reshape(1) if tensor.dim() == 0 else tensor)

    def barrier(self) -> None:
        """Wait until every worker still in the job gets here."""
        self._collectives().run("max", torch.zeros(1))

    def preempted(self) -> bool:
        """This worker's own SIGTERM: workers that train on their own need not stop at one step,
        and asking the others every step would tie them together."""
        return preemption.requested()

    def _collectives(self) -> Collectives:
        if "_meet" not in self.__dict__:
            self._meet = Collectives(ServerClient(self.servers[0], self.token), self.worker, self.num_workers, self.timeout)
        return self._meet

    def shutdown(self) -> None:
        if self.variables is not None:
            self.variables.close()
        if "_meet" in self.__dict__:
            self._meet.client.close()


def _percentiles(histogram: dict[int, int]) -> dict[str, float]:
    """Median, 90th percentile and maximum of a staleness histogram."""
    total = sum(histogram.values())
    if not total:
        return {}
    out, seen = {}, 0
    for value in sorted(histogram):
        seen += histogram[value]
        if "staleness_p50" not in out and seen >= 0.5 * total:
            out["staleness_p50"] = float(value)
        if "staleness_p90" not in out and seen >= 0.9 * total:
            out["staleness_p90"] = float(value)
    out["staleness_max"] = float(max(histogram))
    return out


def server_rule(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The server-side update rule equal to a torch optimizer the user built."""
    group = optimizer.param_groups[0]
    if isinstance(optimizer, torch.optim.SGD):
        if group.get("momentum"):
            return {"name": "momentum", "lr": group["lr"], "momentum": group["momentum"]}
        return {"name": "sgd", "lr": group["lr"]}
    if isinstance(optimizer, torch.optim.Adagrad):
        return {"name": "adagrad", "lr": group["lr"], "eps": group["eps"], "initial_accumulator": group["initial_accumulator_value"]}
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.SparseAdam)):
        return {"name": "adam", "lr": group["lr"], "betas": list(group["betas"]), "eps": group["eps"]}
    raise ValueError(
        f"{type(optimizer).__name__} cannot run on the parameter servers; use SGD (with or without momentum), Adagrad or Adam"
    )


def _materialize(model: nn.Module) -> None:
    """Give parameters built on the meta device real memory and their modules' initialization."""
    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters") and not isinstance(module, RemoteEmbedding):
            module.reset_parameters()


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
