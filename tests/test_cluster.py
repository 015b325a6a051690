import json

import pytest

from loom.cluster import (
    NodeSpec,
    ParameterServerCluster,
    SlurmEnvironment,
    TFConfigEnvironment,
    TorchrunEnvironment,
    expand_slurm_nodelist,
    parse_endpoint,
    resolve_node,
)
from loom.errors import ClusterError

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h0", "MASTER_PORT": "29500"}


def test_torchrun_environment():
    assert TorchrunEnvironment.detect(TORCHRUN)
    spec = TorchrunEnvironment.resolve(TORCHRUN)
    assert (spec.rank, spec.world_size, spec.local_rank, spec.node_rank, spec.nnodes) == (5, 8, 1, 1, 2)
    assert not TorchrunEnvironment.detect({"RANK": "0"})


def test_torchrun_uneven_nodes_rejected():
    with pytest.raises(ClusterError, match="same number of processes"):
        TorchrunEnvironment.resolve({**TORCHRUN, "WORLD_SIZE": "7"})


def tf_config(task_type="worker", index=1):
    return json.dumps({"cluster": {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222"]}, "task": {"type": task_type, "index": index}})


def test_tf_config_chief_first():
    node = TFConfigEnvironment.resolve({"TF_CONFIG": tf_config("worker", 1)})
    assert node == NodeSpec(nnodes=3, node_rank=2, master_addr="c0", master_port=2222, hosts=("c0", "w0", "w1"), source="TF_CONFIG")
    assert TFConfigEnvironment.resolve({"TF_CONFIG": tf_config("chief", 0)}).node_rank == 0


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"cluster": {"worker": ["a:1"]}, "task": ', "TF_CONFIG is not valid JSON"),
        ('{"cluster": {"worker": ["a:1"]}}', "lacks a 'cluster' or 'task'"),
        ('{"cluster": {}, "task": {"type": "worker", "index": 0}}', "names no 'chief' or 'worker'"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}', r"task worker\[3\] is not in the cluster \(worker\[0\]\)"),
        ('{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}', "'a' is not HOST:PORT"),
    ],
)
def test_malformed_tf_config_says_what_is_wrong(text, message):
    with pytest.raises(ClusterError, match=message):
        TFConfigEnvironment.resolve({"TF_CONFIG": text})


def test_slurm_nodelist():
    assert expand_slurm_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    node = SlurmEnvironment.resolve({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2"})
    assert (node.nnodes, node.node_rank, node.master_addr, node.source) == (2, 1, "n1", "Slurm")


def test_flags_win_and_are_checked(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config())
    node = resolve_node(nnodes=2, node_rank=1, master="10.0.0.1:1234")
    assert (node.nnodes, node.node_rank, node.master_addr, node.master_port, node.source) == (2, 1, "10.0.0.1", 1234, "flags")
    assert resolve_node().source == "TF_CONFIG"
    with pytest.raises(ClusterError, match="node rank 2 is outside 0..1"):
        resolve_node(nnodes=2, node_rank=2, master="h:1")
    with pytest.raises(ClusterError, match="needs a master address"):
        resolve_node(nnodes=2, node_rank=0)
    with pytest.raises(ClusterError, match="not HOST:PORT"):
        parse_endpoint("h:99999")


def ps_config(task_type, index, chief=True):
    cluster = {"ps": ["10.0.0.1:2222", "10.0.0.2:2222"], "worker": ["10.0.0.3:2222", "10.0.0.4:2222"]}
    return {"TF_CONFIG": json.dumps({"cluster": {**cluster, **({"chief": ["10.0.0.5:2222"]} if chief else {})},
                                     "task": {"type": task_type, "index": index}})}  # fmt: skip


def test_parameter_server_roles_from_tf_config_and_from_flags_agree(monkeypatch):
    servers = ("10.0.0.1:2222", "10.0.0.2:2222")
    assert ParameterServerCluster.from_tf_config(ps_config("ps", 1)) == ParameterServerCluster(servers, 3, "ps", 1, "TF_CONFIG")
    assert ParameterServerCluster.from_tf_config(ps_config("chief", 0)).index == 0  # the chief is worker 0
    assert ParameterServerCluster.from_tf_config(ps_config("worker", 1)) == ParameterServerCluster(servers, 3, "worker", 2, "TF_CONFIG")
    assert ParameterServerCluster.from_tf_config(ps_config("worker", 1, chief=False)).index == 1  # no chief: worker 0 is
    assert ParameterServerCluster.from_tf_config({"TF_CONFIG": tf_config()}) is None  # no ps: a MultiWorkerMirrored cluster
    flags = ParameterServerCluster.resolve(",".join(servers), 3, "worker", 2)
    assert (flags.servers, flags.workers, flags.role, flags.index, flags.source) == (servers, 3, "worker", 2, "flags")
    assert ParameterServerCluster.resolve(",".join(servers), 3, "ps", None).address == "10.0.0.1:2222"
    monkeypatch.setenv("TF_CONFIG", ps_config("ps", 0)["TF_CONFIG"])
    assert ParameterServerCluster.resolve().role == "ps"
    monkeypatch.delenv("TF_CONFIG")
    assert ParameterServerCluster.resolve() is None


@pytest.mark.parametrize(
    "task, message",
    [
        (("evaluator", 0), "loom runs no side-car evaluator; evaluate on the chief"),
        (("ps", 2), r"ps index 2 is outside 0..1: the job has 2 ps task\(s\) \(TF_CONFIG\)"),
        (("worker", 2), r"worker index 3 is outside 0..2"),
        (("chief", 1), r"task chief\[1\]: there is one chief"),
        (("master", 0), "task type 'master' is not 'ps', 'worker' or 'chief'"),
    ],
)
def test_bad_parameter_server_tasks_are_named(task, message):
    with pytest.raises(ClusterError, match=message):
        ParameterServerCluster.from_tf_config(ps_config(*task))


def test_bad_parameter_server_flags_are_named():
    with pytest.raises(ClusterError, match="needs --ps-hosts HOST:PORT,..., --workers N and --role ps|worker"):
        ParameterServerCluster.resolve(None, 2, "worker", 0)
    with pytest.raises(ClusterError, match=r"parameter server address \(flags\) 'h1' is not HOST:PORT"):
        ParameterServerCluster.resolve("h1,h2:1", 2, "worker", 0)
    with pytest.raises(ClusterError, match="needs at least one worker"):
        ParameterServerCluster.resolve("h:1", 0, "worker", 0)
