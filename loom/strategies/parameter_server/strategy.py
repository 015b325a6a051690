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
from numbers import Number
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from loom.comm import preemption
from loom.errors import LoomError
from loom.strategies.base import OptimizerFactory, Strategy, unwrap
from loom.strategies.parameter_server.checkpoints import mirror, plain_state, pull_all, write_back
from loom.strategies.parameter_server.client import ServerClient
from loom.strategies.parameter_server.collectives import Collectives
from loom.strategies.parameter_server.partitioner import place
from loom.strategies.parameter_server.refusals import refuse_batchnorm, refuse_tied_tables
from loom.strategies.parameter_server.remote_embedding import RemoteEmbedding
from loom.strategies.optimizer import check_owned
from loom.strategies.precision import canonical
from loom.strategies.tf_compat import InputContext, reduce_arguments
from loom.strategies.parameter_server.variables import ShardedVariables, worker_name
from loom.strategies.parameter_server.worker_optimizer import ParameterServerOptimizer, server_rule

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
RATE_WINDOW = 10.0  # seconds the job report's rates are taken over
CHECKPOINT_ID = "parameter_server_checkpoint"  # a saved value naming the checkpoint, for the servers' lineage
NO_CLIPPING = (
    "ParameterServerStrategy cannot clip the global gradient norm (each worker holds only its share of the "
    "gradient, and the servers apply it shard by shard); drop max_grad_norm / clip_gradients, or use MirroredStrategy"
)


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
        lazy_rows: bool = False,
    ) -> None:
        """``staleness``: None for fully asynchronous workers; K to keep every worker within K
        steps of the slowest live one; 0 for lockstep (each step sees every worker's last one,
        each worker's gradient applied on its own). ``synchronous``: each step the servers apply
        the mean of every worker's gradients once, so N workers train as one on the global batch.
        ``lazy_rows``: a step updates only the table rows it pushed, and their optimizer slots
        (as TensorFlow's LazyAdam): far less work per step on a large table, but momentum, Adam
        and weight decay no longer move the other rows as torch's dense step does (the default)."""
        super().__init__(precision, timeout)
        self.lazy_rows = lazy_rows
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
        if self.synchronous and canonical(precision) == "16-mixed":
            raise ValueError(
                "synchronous parameter servers cannot skip an fp16 step that overflowed on one worker on every worker at "
                "once; use precision='bf16-mixed', or asynchronous training"
            )
        self.variables: ShardedVariables | None = None
        self.coordinated = False  # a ClusterCoordinator schedules the steps: the chief coordinates, the others run them
        self.in_function = False  # a worker is running a scheduled function
        self._optimizers_prepared: list[ParameterServerOptimizer] = []
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
        """Swap the tables for remote ones, have the chief create every variable on the servers with
        the optimizer's rule, and wrap the model in the strategy's precision.

        A table follows the parameter group its weight is in, with an optimizer built before;
        with a factory (which never sees the tables) it follows the first group.
        """
        tables = {n: m for n, m in model.named_modules() if isinstance(m, EMBEDDINGS)}
        for name, module in tables.items():
            if module.max_norm is not None:
                raise ValueError(
                    f"embedding '{name}' has max_norm={module.max_norm}, which rewrites the table's rows during the "
                    "forward pass; the table lives on the parameter servers: drop max_norm, or use MirroredStrategy"
                )
        refuse_tied_tables(model, tables)
        refuse_batchnorm(model)
        if isinstance(optimizer, torch.optim.Optimizer):
            check_owned(optimizer, model.parameters())
        names_before = {id(p): n for n, p in model.named_parameters()}  # the tables' weights included
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
        prebuilt = isinstance(optimizer, torch.optim.Optimizer)
        groups = _groups_by_name(optimizer, names_before) if prebuilt else {}
        for name, module in tables.items():
            trained = not prebuilt or f"{name}.weight" in groups
            _replace(model, name, RemoteEmbedding(name, module, self.variables, trained))
        _materialize(model)  # built under scope(): the dense layers get memory now, the tables never
        inner = optimizer if prebuilt else optimizer(model.parameters())
        if not prebuilt:
            groups = _groups_by_name(inner, {id(p): n for n, p in model.named_parameters()})
        assign = {n: i for n, i in groups.items() if n.removesuffix(".weight") not in tables}
        assign.update({n: groups.get(f"{n}.weight", 0) for n in tables})
        if self.is_chief:
            dense = {n: p.detach() for n, p in model.named_parameters()}
            self.variables.create(dense, {n: t for n, t in initial.items() if not t.is_meta}, server_rule(inner, assign, self.lazy_rows),
                                  {n: (t.shape[1], self.worker, tables[n].padding_idx) for n, t in initial.items() if t.is_meta})  # fmt: skip
        else:
            self._wait_until_created(clients)
        if self.synchronous:
            self.variables.join_rounds()
        else:  # a restarted worker goes on from its predecessor's steps, not from 0 (staleness counts them)
            self.variables.clock = max(int(c.call({"op": "stats"})[0]["progress"].get(str(self.worker), 0)) for c in clients)
        self._optimizers += 1  # its steps go through the precision's scaler
        opt = ParameterServerOptimizer(inner, model, self.variables, self.num_workers, self.staleness, self.synchronous,
                                       trained=groups, precision=self.precision, should_step=lambda: self.sync_gradients,
                                       lazy_rows=self.lazy_rows or isinstance(inner, torch.optim.SparseAdam))  # fmt: skip
        self._optimizers_prepared.append(opt)
        self._pull_latest()
        return self.precision.wrap(model), opt

    def _pull_latest(self) -> None:
        """The prepared models' dense parameters, as the servers hold them now (tables are read as used)."""
        for opt in self._optimizers_prepared:
            for name, value in self._prepared().pull_dense(list(opt.dense)).items():
                opt.dense[name].data.copy_(value)

    def _input_context(self) -> InputContext:
        """Under a ClusterCoordinator one input pipeline per worker that runs steps (the chief runs none),
        each step one replica's, as in TF; else one per worker."""
        if self.coordinated:
            return InputContext(self.num_workers - 1, self.worker - 1, 1)
        return super()._input_context()

    def reduce(self, value: torch.Tensor | Number, op: str = "mean", axis: int | None = None) -> torch.Tensor | Number:
        """Over every worker, as ``Strategy.reduce``; inside a scheduled function over its one replica, as
        TF's reduce inside a ClusterCoordinator's function is over that worker's replicas."""
        if self.in_function:
            return reduce_arguments(value, op, axis)[0]
        return super().reduce(value, op, axis)

    def prefetch(self, model: nn.Module, ids: dict[str, torch.Tensor]) -> None:
        """Have this step's ``optimizer.step()`` bring the rows the next batch needs: ``ids`` maps
        each table's name in the model (``model.named_modules()``) to the ids the next forward
        pass gives it.

        The rows come in the reply that brings the newest dense parameters after the push (the
        commit; in synchronous or bounded-staleness training, the read after the step's
        synchronisation), so the next forward pass makes no round trip of its own, and every
        value read is the one it would read without prefetching. A pull of its own beside the
        step would cost a round trip and a thread competing with the step for the cores (on
        W3 it made workers slower). A forward pass given other ids than those prefetched, or
        run with no step between, pulls its own.
        """
        tables = {n: m for n, m in unwrap(model).named_modules() if isinstance(m, RemoteEmbedding)}
        for name, table_ids in ids.items():
            if name not in tables:
                raise ValueError(f"prefetch: the model has no table '{name}'; its tables are {sorted(tables)}")
            tables[name].prefetch(table_ids)

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
        """Wait for the chief to create the variables, at most the job's timeout: a chief that
        failed (its optimizer refused, say) never will."""
        give_up = time.monotonic() + self.timeout
        for client in clients:
            while not client.call({"op": "ready"})[0]["ready"]:
                if time.monotonic() > give_up:
                    raise LoomError(
                        f"the chief (worker 0) did not create the variables on the servers within {self.timeout:g}s: it "
                        "failed or has not started; see its launcher's output (--timeout or LOOM_TIMEOUT sets the wait)"
                    )
                time.sleep(0.1)

    def _clip_grad_norm(self, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise ValueError(NO_CLIPPING)  # train_step(max_grad_norm=) and clip_gradients both come here

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

    def _transport(self) -> Collectives:
        """Workers share no process group: ``reduce`` and ``gather`` meet at server 0, over every
        worker still in the job, in worker order."""
        return self._collectives()

    def barrier(self) -> None:
        """Wait until every worker still in the job gets here."""
        self._collectives().run("max", torch.zeros(1))

    def preempted(self) -> bool:
        """This worker's own SIGTERM: workers that train on their own need not stop at one step,
        and asking the others every step would tie them together."""
        return preemption.requested()

    def _collectives(self) -> Collectives:
        if self.in_function:
            raise LoomError(
                "gather and barrier inside a scheduled function would wait for workers running other steps; "
                "return the value and combine the fetched results on the coordinator"
            )
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


def _groups_by_name(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, int]:
    """Parameter name -> the index of the optimizer's group holding it."""
    return {names[id(param)]: index for index, group in enumerate(optimizer.param_groups) for param in group["params"]}


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
