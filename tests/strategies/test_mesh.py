"""The Mesh: named degrees that multiply to the world size, laid out as torch's DeviceMesh lays them."""

from __future__ import annotations

import pytest

import loom
from loom.errors import ClusterError
from loom.strategies.model_parallel.mesh import Mesh


def test_degrees_multiply_to_the_world_and_minus_one_takes_the_rest():
    assert Mesh({"dp": 2, "pp": 2}, 4).degrees == {"pp": 2, "dp": 2}
    assert Mesh({"tp": 2, "dp_shard": -1}, 8).degrees == {"dp_shard": 4, "tp": 2}
    assert Mesh({"dp": 2, "dp_shard": 2}, 4).replicas == 4
    assert Mesh({"dp_shard": 2, "tp": 2}, 4).replicas == 2
    assert Mesh({"pp": 2, "tp": 2}, 4).replicas == 1


def test_ranks_are_laid_out_outermost_first_whatever_the_order_given():
    """``arange(world).view(pp, dp, dp_shard, tp)``: tp peers are neighbouring ranks, as in init_device_mesh."""
    mesh = Mesh({"tp": 2, "dp": 2, "pp": 2}, 8)
    assert mesh.names == ("pp", "dp", "tp")
    assert [mesh.coordinate(r, "tp") for r in range(8)] == [0, 1] * 4
    assert [mesh.coordinate(r, "dp") for r in range(8)] == [0, 0, 1, 1] * 2
    assert [mesh.coordinate(r, "pp") for r in range(8)] == [0] * 4 + [1] * 4
    assert mesh.coordinate(5, "dp_shard") == 0  # an axis the mesh does not have
    assert mesh.replica_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]  # ranks that differ only in dp
    assert [mesh.replica_index(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_hsdp_counts_both_data_axes_as_replicas():
    mesh = Mesh({"dp": 2, "dp_shard": 2}, 4)
    assert mesh.replica_groups() == [[0, 1, 2, 3]]
    assert [mesh.replica_index(r) for r in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "degrees, world, message",
    [
        ({"dp": 2, "pp": 2}, 6, "mesh {'dp': 2, 'pp': 2} needs 4 processes but the job has 6: make the degrees multiply to 6, or give one axis -1"),
        ({"dp": -1, "tp": 4}, 6, "mesh {'dp': -1, 'tp': 4} cannot fill 6 processes: 4 does not divide 6; change the degrees or the number of processes"),
        ({"dp": 2, "model": 2}, 4, "unknown mesh axis 'model'; name the axes among pp, dp, dp_shard, tp"),
        ({"dp": -1, "tp": -1}, 4, "mesh degrees must be positive integers, with at most one -1 for what is left: got {'dp': -1, 'tp': -1}"),
        ({"dp": 0}, 4, "mesh degrees must be positive integers, with at most one -1 for what is left: got {'dp': 0}"),
    ],
)
def test_bad_degrees_are_one_line(degrees, world, message):
    with pytest.raises((ClusterError, ValueError)) as error:
        Mesh(degrees, world)
    assert str(error.value) == message


def test_a_strategy_checks_its_mesh_against_the_launch_before_joining(monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="6", LOCAL_RANK="0", LOCAL_WORLD_SIZE="6", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ClusterError, match=r"^mesh \{'dp': 2, 'pp': 2\} needs 4 processes but the job has 6: "):
        loom.HybridStrategy(mesh={"dp": 2, "pp": 2})
    with pytest.raises(ClusterError, match=r"^Mesh\(\{'dp': 2, 'tp': 2\}\) was made for 4 processes but the job has 6$"):
        loom.HybridStrategy(mesh=Mesh({"dp": 2, "tp": 2}, 4))
