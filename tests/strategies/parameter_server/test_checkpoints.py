"""Parameter-server checkpoints: tables and optimizer slots saved, moved between strategies, restored."""

import pytest
import torch
import torch.nn.functional as F

import loom
from loom.strategies.parameter_server import transport
from loom.strategies.parameter_server.checkpoints import pull_variable
from loom.strategies.parameter_server.server import ParameterServer
from loom.strategies.parameter_server.strategy import ParameterServerStrategy
from tests.helpers import free_port
from tests.scripts.clicks import Clicks


def adagrad(params):
    return torch.optim.Adagrad(params, lr=0.1)  # its slots: a sum per weight, and the step


def batches(n, rows=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, rows, (16, 5), generator=g)
        yield ids, (ids % 7 == 0).any(1).float()


def train(model, opt, data):
    for ids, y in data:
        F.binary_cross_entropy_with_logits(model(ids), y).backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def fresh_servers():
    """``fresh_servers()``: two new servers' addresses (a job started again has new servers)."""
    started = []

    def make():
        started.extend(ParameterServer("job") for _ in range(2))
        return [f"127.0.0.1:{s.serve(free_port())}" for s in started[-2:]]

    yield make
    for s in started:
        s.stop()


def on_servers(addresses, build=Clicks, optimizer=adagrad):
    strategy = ParameterServerStrategy(addresses, token="job", worker=0, num_workers=1)
    model, opt = strategy.prepare(build(), optimizer)
    return strategy, model, opt


def server_state(strategy):
    """Every variable and its slots, as the servers hold them."""
    names = [*strategy.variables.placement.dense, *strategy.variables.placement.row_bounds]
    return {name: pull_variable(strategy.variables, name) for name in names}


def test_a_checkpoint_holds_the_servers_tables_and_slots_and_restores_under_one_device(fresh_servers, tmp_path):
    strategy, model, opt = on_servers(fresh_servers())
    train(model, opt, batches(4))
    strategy.save(tmp_path, step=4, model=model, optimizer=opt)
    held = server_state(strategy)
    one = loom.OneDeviceStrategy()
    local, local_opt = one.prepare(Clicks(), adagrad)
    one.restore(tmp_path, model=local, optimizer=local_opt)
    assert torch.equal(local.bag.weight, held["bag"][0]) and torch.equal(local.mlp[0].weight, held["mlp.0.weight"][0])
    state = local_opt.state_dict()["state"]
    table = next(i for i, p in enumerate(local.parameters()) if p is local.bag.weight)
    assert torch.equal(state[table]["sum"], held["bag"][1]["sum"]) and state[table]["sum"].abs().sum() > 0
    assert state[table]["step"].item() == 4


def test_a_one_device_checkpoint_restores_under_parameter_servers_with_its_slots(fresh_servers, tmp_path):
    """Training goes on from it exactly as it would have on one device: the servers got the
    values and the Adagrad sums, and restoring pushed no update of its own."""
    one = loom.OneDeviceStrategy()
    local, local_opt = one.prepare(Clicks(), adagrad)
    train(local, local_opt, batches(3))
    one.save(tmp_path, step=3, model=local, optimizer=local_opt)
    strategy, model, opt = on_servers(fresh_servers())
    strategy.restore(tmp_path, model=model, optimizer=opt)
    restored = server_state(strategy)
    assert torch.equal(restored["bag"][0], local.bag.weight) and torch.equal(model.mlp[0].weight, local.mlp[0].weight)
    train(local, local_opt, batches(2, seed=1))
    train(model, opt, batches(2, seed=1))
    assert torch.allclose(strategy.variables.pull_rows("bag", torch.arange(50)), local.bag.weight, atol=1e-6)
    assert torch.allclose(model.mlp[0].weight, local.mlp[0].weight, atol=1e-6)


def test_a_table_larger_than_a_message_saves_and_restores(fresh_servers, tmp_path, monkeypatch):
    monkeypatch.setattr(transport, "MESSAGE_LIMIT", 64 << 10)  # each server's share of the table: 125 KiB
    strategy = ParameterServerStrategy(fresh_servers(), token="job", worker=0, num_workers=1)
    with strategy.scope():
        big = Clicks(rows=8000)
    model, opt = strategy.prepare(big, adagrad)
    train(model, opt, batches(2, rows=8000))
    strategy.save(tmp_path, step=2, model=model, optimizer=opt)
    saved = server_state(strategy)
    again = ParameterServerStrategy(fresh_servers(), token="job", worker=0, num_workers=1)
    with again.scope():
        other = Clicks(rows=8000)
    model, opt = again.prepare(other, adagrad)
    again.restore(tmp_path, model=model, optimizer=opt)
    restored = server_state(again)
    assert torch.equal(restored["bag"][0], saved["bag"][0]) and torch.equal(restored["bag"][1]["sum"], saved["bag"][1]["sum"])


def test_a_restarted_worker_resumes_with_the_servers_newer_state(fresh_servers, tmp_path):
    """fit(checkpoint_dir=...) in a restarted worker: its loader and epoch come from the
    checkpoint, the servers keep what they learned since (values and slots), and nothing crashes."""
    addresses = fresh_servers()
    data = [(ids, y) for ids, y in batches(4)]
    dataset = torch.utils.data.TensorDataset(torch.cat([i for i, _ in data]), torch.cat([y for _, y in data]))
    loss = lambda out, y: F.binary_cross_entropy_with_logits(out, y)  # noqa: E731
    strategy = ParameterServerStrategy(addresses, token="job", worker=0, num_workers=1)
    loom.fit(Clicks(), loss, adagrad, dataset, epochs=1, batch_size=16, strategy=strategy, progress=False, checkpoint_dir=str(tmp_path))
    model, opt = strategy.prepare(Clicks(), adagrad)  # training goes on past the checkpoint
    train(model, opt, batches(3, seed=2))
    newer = server_state(strategy)
    restarted = ParameterServerStrategy(addresses, token="job", worker=0, num_workers=1)
    history = loom.fit(Clicks(), loss, adagrad, dataset, epochs=1, batch_size=16, strategy=restarted, progress=False,
                       checkpoint_dir=str(tmp_path))  # fmt: skip
    assert len(history["loss"]) == 1  # epoch 0's, from the checkpoint: nothing left to train
    after = server_state(restarted)
    for name, (value, slots) in newer.items():
        assert torch.equal(after[name][0], value) and torch.equal(after[name][1]["sum"], slots["sum"]), name


def test_the_plain_optimizer_keeps_the_users_class_and_groups_with_the_tables_in_the_first():
    from torch import nn

    from loom.strategies.parameter_server.checkpoints import plain_optimizer

    model = nn.Sequential(nn.Linear(2, 2), nn.Embedding(5, 2))
    user = torch.optim.AdamW([{"params": [model[0].weight]}, {"params": [model[0].bias], "lr": 0.5}], lr=0.01, weight_decay=0.1, amsgrad=True)
    names = {id(model[0].weight): "0.weight", id(model[0].bias): "0.bias"}
    plain = plain_optimizer(user, names, model, ["1.weight"])
    assert type(plain) is torch.optim.AdamW and [g["lr"] for g in plain.param_groups] == [0.01, 0.5]
    assert plain.param_groups[0]["params"] == [model[0].weight, model[1].weight] and plain.param_groups[0]["weight_decay"] == 0.1
    assert set(plain.state[model[1].weight]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}  # as torch keys them
