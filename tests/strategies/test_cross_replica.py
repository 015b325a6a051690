"""One reduce and one gather for every strategy: the rules are the same whatever carries the values."""

from types import SimpleNamespace

import pytest
import torch

import loom
from loom.strategies import cross_replica
from loom.strategies.cross_replica import Alone
from loom.strategies.xla.hosts import Hosts


class Replicas:
    """Three replicas that hold the same value: what a transport sees, without processes."""

    def all_reduce(self, tensor, op):
        stacked = torch.stack([tensor] * 3)
        return {"sum": stacked.sum(0), "mean": stacked.sum(0) / 3, "max": stacked.amax(0), "min": stacked.amin(0), "product": stacked.prod(0)}[op]

    def all_gather(self, tensor):
        return torch.cat([tensor] * 3)


def test_numbers_come_back_as_numbers_an_int_stays_an_int_unless_averaged():
    assert cross_replica.reduce(2, "sum", Replicas()) == 6 and isinstance(cross_replica.reduce(2, "sum", Replicas()), int)
    assert cross_replica.reduce(2, "mean", Replicas()) == 2.0 and isinstance(cross_replica.reduce(2, "mean", Replicas()), float)
    assert cross_replica.reduce(0.5, "product", Replicas()) == 0.125


def test_an_integer_tensor_is_averaged_in_float64_and_keeps_its_dtype_otherwise():
    ints = torch.tensor([1, 2])
    assert cross_replica.reduce(ints, "mean", Replicas()).dtype == torch.float64
    assert cross_replica.reduce(ints, "max", Replicas()).dtype == torch.int64
    assert torch.equal(cross_replica.reduce(ints, "sum", Replicas()), torch.tensor([3, 6]))
    assert ints.tolist() == [1, 2]  # the caller's tensor is not reduced in place


def test_a_0d_tensor_is_gathered_as_one_element_per_replica():
    assert cross_replica.gather(torch.tensor(4.0), Replicas()).tolist() == [4.0, 4.0, 4.0]
    alone = torch.tensor([1.0])
    assert cross_replica.gather(alone, Alone()) is not alone


def test_bad_values_and_ops_are_refused_in_one_line_by_every_transport():
    for transport in (Replicas(), Alone()):
        with pytest.raises(ValueError, match="unknown reduce op 'avg'; use one of sum, mean, max, min, product"):
            cross_replica.reduce(1.0, "avg", transport)
        with pytest.raises(TypeError, match="reduce\\(\\) takes a tensor or a number, not str"):
            cross_replica.reduce("1", "sum", transport)


def test_one_replica_transports_give_the_same_values_as_one_device():
    """A pipeline without a dp axis (Alone), or an XLA job on one host, is one replica: OneDevice's answers."""
    one = loom.OneDeviceStrategy()
    for transport in (Alone(), Hosts(SimpleNamespace(process_count=lambda: 1))):
        for value, op in [(torch.tensor([1, 2]), "mean"), (torch.tensor([1, 2]), "max"), (3, "sum"), (3, "mean"), (torch.tensor(2.5), "sum")]:
            a, b = cross_replica.reduce(value, op, transport), one.reduce(value, op)
            assert type(a) is type(b) and (a == b if not isinstance(a, torch.Tensor) else a.dtype == b.dtype and torch.equal(a, b))
        assert torch.equal(cross_replica.gather(torch.tensor(1.0), transport), one.gather(torch.tensor(1.0)))
