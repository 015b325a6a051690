"""Who is in the job. Each scheduler is one small resolver with a ``detect()``.

Resolvers answer two different questions:

* inside a worker process, *which rank am I* (torchrun's environment, always, because every
  loom worker is started by torchrun's agent);
* before launching, *which node am I and where is the master* (TF_CONFIG, Slurm or flags),
  which the launcher hands to torchrun.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from dataclasses import dataclass, field

from loom.errors import ClusterError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class NodeSpec:
    """What the launcher needs to start this node's agent."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: pick a free port (single node only)
    hosts: tuple[str, ...] = ()
    source: str = "local"

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ClusterError(f"nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ClusterError(
                f"node rank {self.node_rank} is outside 0..{self.nnodes - 1} for a job of "
                f"{self.nnodes} node(s) ({self.source}); give each node a distinct rank below nnodes"
            )
        if self.nnodes > 1 and self.master_port is None:
            raise ClusterError(
                f"a job of {self.nnodes} nodes needs a master address: pass --master HOST:PORT "
                "(the same on every node)"
            )


@dataclass(frozen=True)
class ClusterSpec:
    """Where this process stands in a running job, as torchrun's agent told it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    host: str = field(default_factory=socket.gethostname)

    @property
    def nnodes(self) -> int:
        return self.world_size // self.local_world_size


def parse_endpoint(text: str, what: str = "--master") -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), with an error that shows the expected form."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"{what} {text!r} is not HOST:PORT (for example 10.0.0.1:{DEFAULT_PORT})")
    return host, int(port)


class TorchrunEnvironment:
    """The variables torchrun (and loom run, which is torchrun) sets in every worker."""

    REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

    @staticmethod
    def detect(env: dict[str, str] | None = None) -> bool:
        env = os.environ if env is None else env
        return all(k in env for k in TorchrunEnvironment.REQUIRED)

    @staticmethod
    def resolve(env: dict[str, str] | None = None) -> ClusterSpec:
        env = os.environ if env is None else env
        try:
            values = {k: int(env[k]) for k in TorchrunEnvironment.REQUIRED if k != "MASTER_ADDR"}
        except ValueError as exc:
            raise ClusterError(f"a torchrun variable is not an integer ({exc}); check the launcher") from exc
        spec = ClusterSpec(
            rank=values["RANK"],
            world_size=values["WORLD_SIZE"],
            local_rank=values["LOCAL_RANK"],
            local_world_size=values["LOCAL_WORLD_SIZE"],
            node_rank=int(env.get("GROUP_RANK", values["RANK"] // values["LOCAL_WORLD_SIZE"])),
            master_addr=env["MASTER_ADDR"],
            master_port=values["MASTER_PORT"],
        )
        if spec.world_size % spec.local_world_size:
            raise ClusterError(
                f"WORLD_SIZE={spec.world_size} is not a multiple of LOCAL_WORLD_SIZE="
                f"{spec.local_world_size}: every node must run the same number of processes"
            )
        return spec


TF_CONFIG_FORM = 'expected {"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}'


def read_tf_config(env: dict[str, str] | None = None) -> tuple[dict, dict]:
    """TF_CONFIG's ``cluster`` and ``task`` objects, or an error that shows the expected form."""
    env = os.environ if env is None else env
    try:
        config = json.loads(env["TF_CONFIG"])
    except json.JSONDecodeError as exc:
        raise ClusterError(f"TF_CONFIG is not valid JSON ({exc.msg} at char {exc.pos}); {TF_CONFIG_FORM}") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict) or not isinstance(
        config.get("task"), dict
    ):
        raise ClusterError(f"TF_CONFIG lacks a 'cluster' or 'task' object; {TF_CONFIG_FORM}")
    cluster = config["cluster"]
    for role, entries in cluster.items():
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise ClusterError(f"TF_CONFIG cluster.{role} must be a list of 'host:port' strings")
    return cluster, config["task"]


class TFConfigEnvironment:
    """TensorFlow's ``TF_CONFIG`` so TF users keep their cluster files.

    Every ``chief`` and ``worker`` entry is one node; the chief (or worker 0) is the master.
    The port in an entry is the rendezvous port of that node's agent; only the master's is used.
    A cluster with ``ps`` entries is a parameter-server job (``ParameterServerCluster``).
    """

    @staticmethod
    def detect(env: dict[str, str] | None = None) -> bool:
        env = os.environ if env is None else env
        return bool(env.get("TF_CONFIG"))

    @staticmethod
    def resolve(env: dict[str, str] | None = None) -> NodeSpec:
        cluster, task = read_tf_config(env)
        nodes = [(role, i) for role in ("chief", "worker") for i in range(len(cluster.get(role, [])))]
        if not nodes:
            raise ClusterError(f"TF_CONFIG names no 'chief' or 'worker' hosts; {TF_CONFIG_FORM}")
        me = (task.get("type"), task.get("index", 0))
        if me not in nodes:
            roles = ", ".join(f"{r}[{i}]" for r, i in nodes)
            raise ClusterError(f"TF_CONFIG task {me[0]}[{me[1]}] is not in the cluster ({roles}); fix task.type/task.index")
        addrs = [cluster[r][i] for r, i in nodes]
        master_addr, master_port = parse_endpoint(addrs[0], what="TF_CONFIG address")
        return NodeSpec(
            nnodes=len(nodes),
            node_rank=nodes.index(me),
            master_addr=master_addr,
            master_port=master_port,
            hosts=tuple(a.rpartition(":")[0] for a in addrs),
            source="TF_CONFIG",
        )


@dataclass(frozen=True)
class ParameterServerCluster:
    """One process's place in a parameter-server job that spans machines.

    Workers are numbered from 0, and worker 0 is the chief: TF_CONFIG's ``chief`` entry (when
    there is one) is worker 0 and its ``worker`` entries follow. Workers listen on nothing, so
    only the servers' addresses matter.
    """

    servers: tuple[str, ...]  # host:port of every parameter server, in order
    workers: int  # the chief included
    role: str  # "ps" or "worker"
    index: int
    source: str = "flags"

    def __post_init__(self) -> None:
        for address in self.servers:
            parse_endpoint(address, what=f"parameter server address ({self.source})")
        if not self.servers:
            raise ClusterError(f"a parameter-server job needs at least one server address ({self.source})")
        if self.workers < 1:
            raise ClusterError(f"a parameter-server job needs at least one worker ({self.source})")
        if self.role not in ("ps", "worker"):
            raise ClusterError(f"role {self.role!r} is not 'ps' or 'worker' ({self.source})")
        count = len(self.servers) if self.role == "ps" else self.workers
        if not 0 <= self.index < count:
            raise ClusterError(
                f"{self.role} index {self.index} is outside 0..{count - 1}: the job has {count} {self.role} "
                f"task(s) ({self.source}); give each a distinct index below that"
            )

    @property
    def address(self) -> str:
        """A server's own ``host:port``: it listens there, and nowhere else."""
        return self.servers[self.index]

    @staticmethod
    def from_tf_config(env: dict[str, str] | None = None) -> ParameterServerCluster | None:
        """The job TF_CONFIG describes when it has ``ps`` entries; None otherwise."""
        env = os.environ if env is None else env
        if not env.get("TF_CONFIG"):
            return None
        cluster, task = read_tf_config(env)
        if not cluster.get("ps"):
            return None
        kind, index = task.get("type"), task.get("index", 0)
        if kind == "evaluator":
            raise ClusterError("TF_CONFIG task 'evaluator': loom runs no side-car evaluator; evaluate on the chief (worker 0)")
        chiefs = len(cluster.get("chief", []))
        if chiefs > 1:
            raise ClusterError(f"TF_CONFIG lists {chiefs} chiefs; a job has one")
        if kind == "chief" and index != 0:
            raise ClusterError(f"TF_CONFIG task chief[{index}]: there is one chief, index 0")
        if kind not in ("ps", "worker", "chief"):
            raise ClusterError(f"TF_CONFIG task type {kind!r} is not 'ps', 'worker' or 'chief'")
        if kind == "worker":
            index += chiefs
        return ParameterServerCluster(
            servers=tuple(cluster["ps"]),
            workers=chiefs + len(cluster.get("worker", [])),
            role="ps" if kind == "ps" else "worker",
            index=index,
            source="TF_CONFIG",
        )

    @staticmethod
    def resolve(
        ps_hosts: str | None = None, workers: int | None = None, role: str | None = None, index: int | None = None
    ) -> ParameterServerCluster | None:
        """From ``--ps-hosts``/``--role``/``--index``/``--workers``, else TF_CONFIG; None if neither."""
        if ps_hosts is None and role is None:
            return ParameterServerCluster.from_tf_config()
        if ps_hosts is None or role is None or workers is None:
            raise ClusterError(
                "a parameter-server job across machines needs --ps-hosts HOST:PORT,..., --workers N and "
                "--role ps|worker (with --index I) on every machine"
            )
        return ParameterServerCluster(
            servers=tuple(a for a in ps_hosts.split(",") if a), workers=workers, role=role, index=index or 0
        )


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """``'gpu[01-03,07],login1'`` -> ``['gpu01', 'gpu02', 'gpu03', 'gpu07', 'login1']``."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            hi = hi or lo
            hosts += [f"{prefix}{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1)]
    return hosts


class SlurmEnvironment:
    """A Slurm allocation: one loom agent per node (``srun --ntasks-per-node=1 loom run ...``)."""

    @staticmethod
    def detect(env: dict[str, str] | None = None) -> bool:
        env = os.environ if env is None else env
        return "SLURM_JOB_NODELIST" in env and "SLURM_NODEID" in env

    @staticmethod
    def resolve(env: dict[str, str] | None = None) -> NodeSpec:
        env = os.environ if env is None else env
        hosts = expand_slurm_nodelist(env["SLURM_JOB_NODELIST"])
        return NodeSpec(
            nnodes=int(env.get("SLURM_JOB_NUM_NODES", len(hosts))),
            node_rank=int(env["SLURM_NODEID"]),
            master_addr=hosts[0],
            master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
            hosts=tuple(hosts),
            source="Slurm",
        )


def resolve_node(
    nnodes: int | None = None, node_rank: int | None = None, master: str | None = None
) -> NodeSpec:
    """Flags win over TF_CONFIG, which wins over Slurm; with none of them, one local node."""
    if nnodes is not None or master is not None:
        addr, port = parse_endpoint(master) if master else ("127.0.0.1", None)
        return NodeSpec(nnodes=nnodes or 1, node_rank=node_rank or 0, master_addr=addr, master_port=port, source="flags")
    for resolver in (TFConfigEnvironment, SlurmEnvironment):
        if resolver.detect():
            return resolver.resolve()
    return NodeSpec()


def seconds_from_env(name: str, default: float, error: type[Exception] = ClusterError) -> float:
    """A finite positive number of seconds from the environment variable ``name``; ``default`` when unset.

    ``nan`` and ``inf`` are refused with the rest: either one would switch off the wait it bounds."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not is_positive_seconds(seconds):
        raise error(f"{name}={text!r} is not a finite positive number of seconds; unset it for the default ({default:g})")
    return seconds


def is_positive_seconds(value: object) -> bool:
    """Whether ``value`` can bound a wait: a finite number above zero (not nan, inf, a bool or a string)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
