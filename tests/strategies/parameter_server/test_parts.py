"""Parameter-server parts: placement, the wire format, server optimizers against torch's."""

import pytest
import torch

from loom.strategies.parameter_server.optimizers import ServerOptimizer
from loom.strategies.parameter_server.partitioner import place, row_bounds
from loom.strategies.parameter_server.wire import WireError, decode, encode


def test_tables_split_by_rows_and_dense_balanced_by_bytes():
    placement = place({"w1": 400, "w2": 300, "b1": 8, "b2": 4}, {"emb": (1_000_001, 128)}, 2)
    assert placement.row_bounds["emb"] == [0, 500_001, 1_000_001]
    loads = placement.server_bytes({"w1": 400, "w2": 300, "b1": 8, "b2": 4}, {"emb": 128})
    assert max(loads) - min(loads) <= 400  # within the largest dense parameter
    assert row_bounds(10, 3) == [0, 4, 7, 10]


def test_rows_by_server_routes_every_id_once():
    placement = place({}, {"emb": (10, 4)}, 3)
    ids = torch.tensor([9, 0, 4, 3, 7, 4])
    parts = placement.rows_by_server("emb", ids)
    positions = torch.cat([p for p, _ in parts]).sort().values
    assert positions.tolist() == list(range(6))
    assert [local.tolist() for _, local in parts] == [[0, 3], [0, 0], [2, 0]]  # ranges [0,4) [4,7) [7,10)
    with pytest.raises(IndexError, match="embedding 'emb' has 10 rows; got ids from 0 to 10"):
        placement.rows_by_server("emb", torch.tensor([0, 10]))


def test_wire_round_trip_and_garbage():
    tensors = {"ids": torch.tensor([3, 1, 2]), "grad": torch.randn(3, 4), "empty": torch.empty(0, 4), "scalar": torch.tensor(1.5)}
    fields, back = decode(encode({"op": "push", "step": 7}, tensors))
    assert fields == {"op": "push", "step": 7}
    assert all(torch.equal(tensors[k], back[k]) for k in tensors)
    with pytest.raises(WireError, match="not a parameter-server message"):
        decode(b"\x05\x00\x00\x00{bad")
    with pytest.raises(WireError, match="runs past the end"):
        decode(encode({}, {"x": torch.ones(4)})[:-1])


def _torch_optimizer(name, params):
    return {
        "sgd": lambda: torch.optim.SGD(params, lr=0.1),
        "momentum": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        "adagrad": lambda: torch.optim.Adagrad(params, lr=0.1, eps=1e-8),
        "adam": lambda: torch.optim.Adam(params, lr=0.1),
    }[name]()


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "adam"])
def test_dense_updates_match_torch(name):
    torch.manual_seed(0)
    ours, theirs = torch.randn(5, 3), torch.nn.Parameter(torch.randn(5, 3))
    ours.copy_(theirs.detach())
    server, reference = ServerOptimizer(name, lr=0.1), _torch_optimizer(name, [theirs])
    for _ in range(5):
        grad = torch.randn(5, 3)
        server.apply_dense("w", ours, grad)
        theirs.grad = grad.clone()
        reference.step()
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-6)


def test_sparse_adam_matches_torch_sparse_adam_and_leaves_other_rows():
    torch.manual_seed(0)
    table = torch.randn(8, 3)
    reference = torch.nn.Parameter(table.clone())
    server, sparse_adam = ServerOptimizer("adam", lr=0.1), torch.optim.SparseAdam([reference], lr=0.1)
    untouched = table[7].clone()
    for rows in ([0, 2, 2, 5], [1, 2], [0, 6, 6]):  # repeats are summed, as a sparse gradient coalesces
        rows_t, grads = torch.tensor(rows), torch.randn(len(rows), 3)
        server.apply_rows("emb", table, rows_t, grads)
        reference.grad = torch.sparse_coo_tensor(rows_t.unsqueeze(0), grads, (8, 3), check_invariants=True)
        sparse_adam.step()
    torch.testing.assert_close(table, reference.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(table[7], untouched)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad"])
def test_sparse_updates_equal_dense_updates_on_the_rows_touched_every_step(name):
    torch.manual_seed(1)
    sparse_table = torch.randn(4, 2)
    dense_table = sparse_table.clone()
    sparse, dense = ServerOptimizer(name, lr=0.1), ServerOptimizer(name, lr=0.1)
    for _ in range(4):
        grads = torch.randn(4, 2)
        sparse.apply_rows("emb", sparse_table, torch.arange(4), grads)
        dense.apply_dense("emb", dense_table, grads)
    torch.testing.assert_close(sparse_table, dense_table)


def test_unknown_optimizer_is_named():
    with pytest.raises(ValueError, match="unknown server optimizer 'rmsprop'; choose one of: sgd, momentum, adagrad, adam"):
        ServerOptimizer("rmsprop")
