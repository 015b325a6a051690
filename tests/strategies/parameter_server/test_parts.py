"""Parameter-server parts: placement, the wire format, server optimizers against torch's."""

import pytest
import torch

from loom.strategies.parameter_server.optimizers import RUNTIME_OPTIONS, ServerOptimizer
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


RULES = {  # server rule -> torch's optimizer with the same hyper-parameters
    "sgd": ("SGD", {"lr": 0.1}),
    "momentum": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "nesterov_decay": ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.05}),
    "adagrad_decay": ("Adagrad", {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.05, "initial_accumulator_value": 0.1}),
    "adagrad_decay_only": ("Adagrad", {"lr": 0.1, "weight_decay": 0.05, "initial_accumulator_value": 0.1}),
    "adam": ("Adam", {"lr": 0.1}),
    "adam_amsgrad_maximize": ("Adam", {"lr": 0.1, "amsgrad": True, "maximize": True, "weight_decay": 0.05}),
    "adamw": ("AdamW", {"lr": 0.1, "weight_decay": 0.1}),
    "rmsprop": ("RMSprop", {"lr": 0.01}),
    "rmsprop_centered_momentum": ("RMSprop", {"lr": 0.01, "alpha": 0.9, "eps": 1e-6, "weight_decay": 0.05, "momentum": 0.9, "centered": True}),
    "adadelta": ("Adadelta", {"lr": 0.5, "rho": 0.8, "eps": 1e-5, "weight_decay": 0.05, "maximize": True}),
}


def _pair(rule, lazy_rows=False):
    kind, hyper = RULES[rule]
    reference_class = getattr(torch.optim, kind)
    group = {**reference_class([torch.zeros(1)], **hyper).defaults, **hyper}  # as a worker sends it
    groups = [{k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if k not in RUNTIME_OPTIONS}]
    return ServerOptimizer(kind, groups, lazy_rows=lazy_rows), lambda params: reference_class(params, **hyper), groups


@pytest.mark.parametrize("rule", list(RULES))
def test_dense_steps_are_torchs_own_with_the_lr_each_push_carries(rule):
    torch.manual_seed(0)
    ours, theirs = torch.randn(5, 3), torch.nn.Parameter(torch.randn(5, 3))
    ours.copy_(theirs.detach())
    server, build, groups = _pair(rule)
    reference = build([theirs])
    for step in range(5):
        lr = 0.1 * 0.5**step  # as a scheduler sets it
        reference.param_groups[0]["lr"] = lr
        grad = torch.randn(5, 3)
        server.apply_dense("w", ours, grad, [{**groups[0], "lr": lr}])
        theirs.grad = grad.clone()
        reference.step()
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-6)
    assert server.state["w"]["step"] == 5


@pytest.mark.parametrize("rule", list(RULES))
def test_exact_row_steps_equal_torchs_dense_step_of_the_whole_table(rule):
    """Rows a push does not name still move where torch moves them (momentum, Adam, weight decay)."""
    torch.manual_seed(1)
    table = torch.randn(8, 3)
    reference = torch.nn.Parameter(table.clone())
    server, build, _ = _pair(rule)
    dense = build([reference])
    for rows in ([0, 2, 2, 5], [1, 2], [0, 6, 6], []):  # repeats are summed; an empty push still steps the table
        rows_t, grads = torch.tensor(rows, dtype=torch.long), torch.randn(len(rows), 3)
        server.apply_rows("emb", table, rows_t, grads)
        reference.grad = torch.zeros(8, 3).index_add_(0, rows_t, grads)
        dense.step()
    torch.testing.assert_close(table, reference.detach(), rtol=1e-6, atol=1e-6)


def test_lazy_adam_matches_torch_sparse_adam_and_leaves_other_rows():
    torch.manual_seed(0)
    table = torch.randn(8, 3)
    reference = torch.nn.Parameter(table.clone())
    server, sparse_adam = _pair("adam", lazy_rows=True)[0], torch.optim.SparseAdam([reference], lr=0.1)
    untouched = table[7].clone()
    for rows in ([0, 2, 2, 5], [1, 2], [0, 6, 6]):  # repeats are summed, as a sparse gradient coalesces
        rows_t, grads = torch.tensor(rows), torch.randn(len(rows), 3)
        server.apply_rows("emb", table, rows_t, grads)
        reference.grad = torch.sparse_coo_tensor(rows_t.unsqueeze(0), grads, (8, 3), check_invariants=True)
        sparse_adam.step()
    torch.testing.assert_close(table, reference.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(table[7], untouched)


@pytest.mark.parametrize("rule", ["momentum", "nesterov_decay", "adagrad_decay_only", "rmsprop_centered_momentum", "adadelta"])
def test_lazy_rows_step_each_row_as_torch_steps_it_alone_when_pushed(rule):
    """lazy_rows: a pushed row takes torch's step on its own slots; a row not pushed does not move."""
    torch.manual_seed(2)
    table = torch.randn(6, 3)
    server, build, _ = _pair(rule, lazy_rows=True)
    alone = [torch.nn.Parameter(row.clone()) for row in table]
    optimizers = [build([row]) for row in alone]
    for rows in ([0, 2, 2], [2, 3], [0, 3, 4]):
        rows_t, grads = torch.tensor(rows), torch.randn(len(rows), 3)
        server.apply_rows("emb", table, rows_t, grads)
        summed = torch.zeros(6, 3).index_add_(0, rows_t, grads)
        for row in set(rows):
            alone[row].grad = summed[row].clone()
            optimizers[row].step()
    torch.testing.assert_close(table, torch.stack([row.detach() for row in alone]), rtol=1e-6, atol=1e-6)
    assert torch.equal(table[5], alone[5].detach())  # never pushed: where it started


@pytest.mark.parametrize("rule", ["sgd", "momentum", "adam"])
def test_lazy_rows_in_increasing_order_step_exactly_as_in_any_order(rule):
    """Increasing ids (what a worker pushes) skip the sort and the scatter; the numbers are the same, bit for bit."""
    torch.manual_seed(3)
    rows, grads = torch.tensor([1, 4, 5, 9]), torch.randn(4, 3)
    grads[0, 0] = -0.0  # summed from zero: +0.0 either way
    order = torch.tensor([2, 0, 3, 1])
    tables = []
    for ids, g in ((rows, grads), (rows[order], grads[order])):
        table = torch.randn(10, 3, generator=torch.Generator().manual_seed(4))
        server = _pair(rule, lazy_rows=True)[0]
        for _ in range(3):
            server.apply_rows("emb", table, ids, g)
        tables.append((table, server.state["emb"]))
    (first, slots), (second, other) = tables
    assert torch.equal(first, second)
    assert all(torch.equal(v, other[k]) if isinstance(v, torch.Tensor) else v == other[k] for k, v in slots.items())


def test_unknown_optimizer_is_named():
    with pytest.raises(ValueError, match="unknown server optimizer 'Rprop'; choose one of: SGD, Adagrad, Adam, AdamW, RMSprop, Adadelta$"):
        ServerOptimizer("Rprop")


def test_slots_written_into_the_state_are_the_ones_the_next_step_uses():
    """A checkpoint that restores a variable's slots replaces ``state``; torch's optimizer follows it."""
    server, build, _ = _pair("momentum")
    ours, theirs = torch.zeros(4), torch.nn.Parameter(torch.zeros(4))
    reference = build([theirs])
    server.apply_dense("w", ours, torch.ones(4))
    server.state["w"] = {"step": 7, "momentum_buffer": torch.full((4,), 3.0)}
    reference.state[theirs] = {"momentum_buffer": torch.full((4,), 3.0)}
    server.apply_dense("w", ours, torch.ones(4))
    theirs.data.copy_(torch.full((4,), -0.1))  # where the first step left it
    theirs.grad = torch.ones(4)
    reference.step()
    torch.testing.assert_close(ours, theirs.detach())
    assert server.state["w"]["step"] == 8
