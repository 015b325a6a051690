"""Parameter servers run the user's optimizer exactly: N synchronous workers equal one device.

Hot rows (ids 0-3 in every sample) are touched by both workers every step; the other rows
only now and then, so momentum, Adam and weight decay moving untouched rows shows.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loom
from loom.strategies.parameter_server.client import ServerClient
from loom.strategies.parameter_server.strategy import ParameterServerStrategy
from tests.scripts.clicks import Clicks
from tests.strategies.parameter_server.test_strategy import _run_workers, servers  # noqa: F401 - a fixture

TOLERANCE = 1e-5


def hot_batches(n, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.cat([torch.arange(4).repeat(size, 1), torch.randint(4, 50, (size, 3), generator=g)], 1)
        yield ids, (ids % 7 == 0).any(1).float()


def _one_device(make_opt, steps=6, model=None):
    local = model or Clicks()
    opt = make_opt(local.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for ids, y in hot_batches(steps):
        F.binary_cross_entropy_with_logits(local(ids), y).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    return local


def _two_synchronous_workers(addresses, make_opt, steps=6, built=None, **options):
    """Each worker takes its half of every global batch; returns each worker's (table, dense params)."""
    built = built or [Clicks(), Clicks()]  # built here: threads would interleave draws from the global RNG
    ends = {}

    def work(worker):
        strategy = ParameterServerStrategy(addresses, token="job-token", worker=worker, num_workers=2, synchronous=True, **options)
        model, opt = strategy.prepare(built[worker], make_opt)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for ids, y in hot_batches(steps):
            half = slice(8 * worker, 8 * worker + 8)
            strategy.backward(F.binary_cross_entropy_with_logits(model(ids[half]), y[half]))
            opt.step()
            opt.zero_grad()
            scheduler.step()
        dense = {n: p.detach().clone() for n, p in model.mlp.named_parameters()}
        ends[worker] = (strategy.variables.pull_rows("bag", torch.arange(50)), dense)
        strategy.shutdown()

    _run_workers(work)
    assert len(ends) == 2, "a worker failed"
    return ends.values()


def _difference(table, dense, local):
    diffs = [(table - local.bag.weight.detach()).abs().max()]
    diffs += [(dense[n] - p.detach()).abs().max() for n, p in local.mlp.named_parameters()]
    return float(max(diffs))


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.05),
    "adamw_weight_decay": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
    "rmsprop_centered_momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.01, momentum=0.9, centered=True),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0, rho=0.8, eps=1e-5, weight_decay=0.01),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_two_synchronous_workers_with_a_step_lr_equal_one_device(servers, name):  # noqa: F811
    """Hot rows both workers touch, rows neither touched this step, and an LR that halves every 2 steps."""
    local = _one_device(OPTIMIZERS[name])
    for table, dense in _two_synchronous_workers(servers, OPTIMIZERS[name]):
        assert _difference(table, dense, local) <= TOLERANCE
    untouched_at_start = Clicks().bag.weight.detach()
    assert (local.bag.weight.detach() - untouched_at_start).abs().max() > 1e-3  # training moved the table


def test_lazy_rows_are_torchs_sparse_adam_on_the_table(servers):  # noqa: F811
    """lazy_rows=True with Adam: the table as torch's SparseAdam steps it, the dense layers as Adam does.

    SparseAdam adds eps before the bias correction, Adam (and lazy rows) after: a tiny eps
    makes that difference vanish."""
    local = Clicks()
    sparse = nn.EmbeddingBag(50, 8, mode="sum", sparse=True)
    sparse.weight.data.copy_(local.bag.weight.detach())
    local.bag = sparse
    table_opt = torch.optim.SparseAdam([local.bag.weight], lr=0.05, eps=1e-12)
    dense_opt = torch.optim.Adam(local.mlp.parameters(), lr=0.05, eps=1e-12)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (table_opt, dense_opt)]
    for ids, y in hot_batches(6):
        F.binary_cross_entropy_with_logits(local(ids), y).backward()
        for o in (table_opt, dense_opt):
            o.step()
            o.zero_grad()
        for s in schedulers:
            s.step()
    for table, dense in _two_synchronous_workers(servers, lambda p: torch.optim.Adam(p, lr=0.05, eps=1e-12), lazy_rows=True):
        assert _difference(table, dense, local) <= TOLERANCE
    exact = _one_device(OPTIMIZERS["adam"])
    assert (exact.bag.weight - local.bag.weight).abs().max() > 1e-3  # the option changes what untouched rows do


def test_parameter_groups_keep_their_own_learning_rates_and_the_table_its_group(servers):  # noqa: F811
    def grouped(model):
        groups = [{"params": [model.bag.weight], "lr": 0.5}, {"params": model.mlp.parameters()}]
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)

    local, remote = Clicks(), Clicks()
    local_opt, remote_opt = grouped(local), grouped(remote)  # built before prepare: the table is in group 0
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1)
    model, opt = strategy.prepare(remote, remote_opt)
    for ids, y in hot_batches(5):
        for m, o in ((local, local_opt), (model, opt)):
            F.binary_cross_entropy_with_logits(m(ids), y).backward()
            o.step()
            o.zero_grad()
    dense = {n: p.detach() for n, p in model.mlp.named_parameters()}
    assert _difference(strategy.variables.pull_rows("bag", torch.arange(50)), dense, local) <= TOLERANCE
    strategy.shutdown()


def test_a_closure_computes_the_gradients_the_step_pushes(servers):  # noqa: F811
    local, remote = Clicks(), Clicks()
    local_opt = OPTIMIZERS["adam"](local.parameters())
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1)
    model, opt = strategy.prepare(remote, OPTIMIZERS["adam"])
    for ids, y in hot_batches(3):
        for m, o in ((local, local_opt), (model, opt)):

            def closure(m=m, o=o):
                o.zero_grad()
                loss = F.binary_cross_entropy_with_logits(m(ids), y)
                loss.backward()
                return loss

            assert o.step(closure) is not None
    dense = {n: p.detach() for n, p in model.mlp.named_parameters()}
    assert _difference(strategy.variables.pull_rows("bag", torch.arange(50)), dense, local) <= TOLERANCE
    strategy.shutdown()


def test_a_bf16_model_saves_the_servers_values(servers, tmp_path):  # noqa: F811
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1, precision="bf16-mixed")
    model, opt = strategy.prepare(Clicks(), OPTIMIZERS["sgd_momentum"])
    for ids, y in hot_batches(2):
        F.binary_cross_entropy_with_logits(model(ids), y).backward()
        opt.step()
        opt.zero_grad()
    saved = strategy.save(tmp_path, step=2, model=model)
    fresh = Clicks()
    loom.OneDeviceStrategy().restore(saved.parent, model=fresh)
    assert torch.equal(fresh.mlp[0].weight, loom.unwrap(model).mlp[0].weight)
    assert torch.equal(fresh.bag.weight, strategy.variables.pull_rows("bag", torch.arange(50)))
    strategy.shutdown()


def test_embedding_options_are_kept(servers):  # noqa: F811
    """A frozen table stays as it was; padding_idx gets no gradient and a bag leaves it out."""

    class Padded(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.bag = nn.EmbeddingBag(50, 8, mode="mean", padding_idx=0)
            self.frozen = nn.Embedding(50, 8)
            self.frozen.weight.requires_grad_(False)
            self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, ids):
            return self.mlp(self.bag(ids) + self.frozen(ids).mean(1)).squeeze(1)

    make_opt = OPTIMIZERS["sgd_momentum"]
    local, remote = Padded(), Padded()
    initial_frozen = local.frozen.weight.detach().clone()
    local_opt = make_opt(local.parameters())
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1)
    model, opt = strategy.prepare(remote, make_opt)
    for ids, y in hot_batches(5):
        ids = ids % 20  # id 0, the padding, in most bags
        for m, o in ((local, local_opt), (model, opt)):
            F.binary_cross_entropy_with_logits(m(ids), y).backward()
            o.step()
            o.zero_grad()
    frozen = strategy.variables.pull_rows("frozen", torch.arange(50))
    assert torch.equal(frozen, initial_frozen)
    dense = {n: p.detach() for n, p in model.mlp.named_parameters()}
    assert _difference(strategy.variables.pull_rows("bag", torch.arange(50)), dense, local) <= TOLERANCE
    assert torch.equal(strategy.variables.pull_rows("bag", torch.tensor([0])), torch.zeros(1, 8))
    strategy.shutdown()


def test_a_table_the_servers_draw_starts_its_padding_row_at_zero(servers):  # noqa: F811
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1)
    with strategy.scope():
        built = nn.Sequential(nn.Embedding(50, 8, padding_idx=30), nn.Linear(8, 1))  # row 30 is on the second server
    strategy.prepare(built, lambda p: torch.optim.SGD(p, lr=0.1))
    table = strategy.variables.pull_rows("0", torch.arange(50))
    assert torch.equal(table[30], torch.zeros(8)) and bool((table[29] != 0).all())
    strategy.shutdown()


def test_accumulation_pushes_once_per_update(servers):  # noqa: F811
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1)
    model, opt = strategy.prepare(Clicks(), OPTIMIZERS["sgd_momentum"])
    with strategy.accumulate(4):
        for ids, y in hot_batches(8, size=4):  # 2 updates of 4 micro-batches
            strategy.backward(F.binary_cross_entropy_with_logits(model(ids), y))
            opt.step()
            opt.zero_grad()
    versions = [ServerClient(a, "job-token").call({"op": "stats"})[0]["version"] for a in servers]
    assert versions == [2, 2]
    strategy.shutdown()


def test_fp16_asynchronous_workers_step_through_the_gradient_scaler(servers):  # noqa: F811
    """Equal to one device in fp16; an overflowed step is skipped (no push) and the scale halves."""
    make_opt = OPTIMIZERS["sgd_momentum"]
    one = loom.OneDeviceStrategy(precision="16-mixed")
    local, local_opt = one.prepare(Clicks(), make_opt)
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1, precision="16-mixed")
    model, opt = strategy.prepare(Clicks(), make_opt)
    for step, (ids, y) in enumerate(hot_batches(4)):
        for s, m, o in ((one, local, local_opt), (strategy, model, opt)):
            loss = F.binary_cross_entropy_with_logits(m(ids), y)
            s.backward(loss * float("inf") if step == 2 else loss)
            o.step()
            o.zero_grad()
    assert strategy.precision.scaler.get_scale() == one.precision.scaler.get_scale() < 65536.0
    versions = [ServerClient(a, "job-token").call({"op": "stats"})[0]["version"] for a in servers]
    assert versions == [3, 3]  # 4 steps, the overflowed one skipped
    dense = {n: p.detach() for n, p in loom.unwrap(model).mlp.named_parameters()}
    assert _difference(strategy.variables.pull_rows("bag", torch.arange(50)), dense, loom.unwrap(local)) <= 1e-4
    strategy.shutdown()


def test_what_the_servers_cannot_run_is_refused_in_one_line(servers):  # noqa: F811
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1)

    class MyAdam(torch.optim.Adam):
        pass

    with pytest.raises(ValueError, match=r"^MyAdam cannot run on the parameter servers; use SGD .*Adagrad, Adam or AdamW .*RMSprop .*Adadelta"):
        strategy.prepare(Clicks(), lambda p: MyAdam(p))
    clipped = nn.Sequential(nn.Embedding(50, 8, max_norm=1.0))
    with pytest.raises(ValueError, match="embedding '0' has max_norm=1.0, which rewrites the table's rows during the forward pass"):
        strategy.prepare(clipped, lambda p: torch.optim.SGD(p, lr=0.1))
    model, opt = strategy.prepare(Clicks(), OPTIMIZERS["sgd_momentum"])
    with pytest.raises(ValueError, match="cannot clip the global gradient norm .*; drop max_grad_norm / clip_gradients"):
        strategy.train_step(model, F.binary_cross_entropy_with_logits, opt, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="cannot clip the global gradient norm"):
        strategy.clip_gradients(opt, 1.0)
    with pytest.raises(ValueError, match="synchronous parameter servers cannot skip an fp16 step .*; use precision='bf16-mixed'"):
        ParameterServerStrategy(servers, token="job-token", synchronous=True, precision="16-mixed")
    strategy.shutdown()
