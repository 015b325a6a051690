"""Gradient compression: PowerSGD trains and restores, compression='auto' picks by bytes and bandwidth."""

import contextlib
import io

import pytest
import torch
import torch.nn.functional as F

import loom
from loom.comm.compression import PowerSGD, choose_compression
from loom.strategies.data_parallel.mirrored import auto_bucket_cap_mb
from tests.helpers import run_ranks

pytestmark = pytest.mark.xdist_group("compression")  # its tests share one launched job

W1 = [torch.Size(s) for s in [(2048, 784), (2048,), (2048, 2048), (2048,), (2048, 2048), (2048,), (10, 2048), (10,)]]
GBIT = 1e9 / 8  # bytes/s


def test_auto_keeps_fp32_on_a_fast_link_and_one_replica():
    assert choose_compression(W1, 100 * GBIT, 2).name == "none"
    assert choose_compression(W1, 0.001 * GBIT, 1).name == "none"  # nothing to send


def test_auto_picks_bf16_when_half_the_bytes_fit_the_budget():
    # 40 MB of fp32 gradients: 2*(1/2)*40 MB at 8 Gbit/s is 40 ms... budget 50 ms: fp32 fits at 10 Gbit/s, bf16 at 4.
    choice = choose_compression(W1, 4 * GBIT, 2)
    assert choice.name == "bf16"
    assert choice.line == (
        "loom: compression='auto' picked bf16: 38.2 MiB of fp32 gradients per step over a 4.00 Gbit/s link take "
        "none 80 ms, bf16 40 ms, powersgd 0 ms (budget 50 ms)"
    )


def test_auto_picks_powersgd_on_a_slow_link_and_suggests_diloco_on_a_very_slow_one():
    assert choose_compression(W1, 1 * GBIT, 2).name == "powersgd"
    assert "DiLoCo" not in choose_compression(W1, 1 * GBIT, 2).line
    crawl = choose_compression(W1, 0.001 * GBIT, 2)
    assert crawl.name == "powersgd" and crawl.line.endswith("; DiLoCoStrategy(sync_every=H) would sync 1/H as often")


def test_powersgd_bytes_are_the_low_rank_factors_of_the_matrices_it_compresses():
    # (100, 50) at rank 2 sends P (100x2) and Q (50x2); a bias goes as is; (3, 2) would not shrink by half.
    assert PowerSGD(rank=2).compressed_bytes([torch.Size((100, 50)), torch.Size((100,)), torch.Size((3, 2))]) == (300 + 100 + 6) * 4


def test_bucket_size_from_the_model():
    assert auto_bucket_cap_mb(W1) == pytest.approx(38.2 / 8, rel=1e-2)  # 8 buckets instead of 2 at 25 MB
    assert auto_bucket_cap_mb([torch.Size((10, 10))]) == 1.0
    assert auto_bucket_cap_mb([torch.Size((100_000, 1000))]) == 25.0


def test_bad_compression_options_get_one_line():
    with pytest.raises(ValueError, match=r"^unknown gradient compression 'zip'; use one of none, fp16, bf16, powersgd, auto, or loom.comm.PowerSGD\(rank=..., error_feedback=...\)$"):
        loom.MirroredStrategy(compression="zip")
    with pytest.raises(ValueError, match=r"^bucket_cap_mb must be a positive number of MB or 'auto', got -1$"):
        loom.MirroredStrategy(bucket_cap_mb=-1)
    with pytest.raises(ValueError, match=r"^PowerSGD\(rank=...\) must be a positive integer, got 0$"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match=r"^PowerSGD\(start_iter=1\) must be at least 2 with error_feedback or warm_start"):
        PowerSGD(start_iter=1)
    with pytest.raises(ValueError, match=r"^DiLoCoStrategy\(sync_every=...\) must be a positive number of optimizer steps, got 0$"):
        loom.DiLoCoStrategy(sync_every=0)
    with pytest.raises(ValueError, match=r"^DiLoCoStrategy needs outer_lr > 0 and 0 <= outer_momentum < 1, got outer_lr=0.7, outer_momentum=1$"):
        loom.DiLoCoStrategy(outer_momentum=1)
    with pytest.raises(ValueError, match=r"^DiLoCoStrategy\(overlap_sync=...\) must be True or False, got 'yes'$"):
        loom.DiLoCoStrategy(overlap_sync="yes")


def _train(strategy):
    from tests.scripts.train_mlp import dataset, mlp

    model, opt = strategy.prepare(mlp(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    step = strategy.train_step(model, F.cross_entropy, opt)
    losses = [float(step(x, y)) for _ in range(2) for x, y in strategy.distribute(dataset(), batch_size=64, seed=7)]
    return model, opt, losses


def _powersgd_and_auto(directory):
    from tests.scripts.train_mlp import mlp

    strategy = loom.MirroredStrategy(compression=PowerSGD(rank=1, start_iter=2), timeout=30)
    model, opt, losses = _train(strategy)
    strategy.save(directory, model=model, optimizer=opt)
    fresh, fresh_opt = strategy.prepare(mlp(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    strategy.restore(directory, model=fresh, optimizer=fresh_opt)
    with contextlib.redirect_stdout(io.StringIO()) as said:
        auto = loom.MirroredStrategy(compression="auto", timeout=30)
        auto.prepare(mlp())
    weights = {k: v.clone() for k, v in loom.unwrap(model).state_dict().items()}
    restored = {k: v.clone() for k, v in loom.unwrap(fresh).state_dict().items()}
    momentum = [s["momentum_buffer"].clone() for s in fresh_opt.state_dict()["state"].values()]
    numerics = _powersgd_numerics()
    strategy.shutdown()
    return losses, weights, restored, momentum, said.getvalue(), numerics


def _powersgd_numerics():
    """Plain DDP against PowerSGD on gradients of known rank, and a constant gradient's error feedback."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(6, 1, 12, generator=g), torch.randint(0, 8, (6, 1), generator=g)
    trained = []
    cases = [(None, 25), (PowerSGD(rank=2, start_iter=2), 25), (PowerSGD(rank=2, start_iter=0, error_feedback=False, warm_start=False), 25)]
    cases.append((PowerSGD(rank=2, start_iter=2), 1e-4))  # a bucket a parameter: several in flight on gloo
    for compression, bucket_cap_mb in cases:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 8)), bucket_cap_mb=bucket_cap_mb)
        if compression is not None:
            hook, state = compression.hook()
            model.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for i in range(6):  # one sample per replica: every weight gradient has rank 1, their mean rank 2
            F.cross_entropy(model(x[i]), y[i]).backward()
            opt.step()
            opt.zero_grad()
        trained.append([p.detach().clone() for p in model.parameters()])

    constant = torch.randn(8, 6, generator=g)  # this replica's gradient, every step

    class Weight(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(8, 6))

        def forward(self):
            return (self.w * constant).sum()

    model = DDP(Weight())
    hook, state = PowerSGD(rank=1, start_iter=2).hook()
    model.register_comm_hook(state, hook)
    for _ in range(6):
        model().backward()
        with torch.no_grad():
            model.module.w -= model.module.w.grad  # SGD at lr 1: w is minus the sum of the applied gradients
        model.module.w.grad = None
    return trained, -model.module.w.detach().clone(), constant, state.error[0].view(8, 6).clone()


@pytest.fixture(scope="session")
def two_replicas(tmp_path_factory):
    return run_ranks(_powersgd_and_auto, 2, str(tmp_path_factory.mktemp("powersgd")), timeout=120)


def test_powersgd_trains_and_restores(two_replicas):
    (losses, weights, restored, momentum, _, _), (_, other, _, _, _, _) = two_replicas
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5])  # it learns
    assert all(torch.equal(weights[k], other[k]) for k in weights)  # every replica applied the same update
    assert all(torch.equal(weights[k], restored[k]) for k in weights) and all(m.abs().sum() > 0 for m in momentum)
    exact = loom.unwrap(_train(loom.OneDeviceStrategy(device="cpu"))[0]).state_dict()
    assert max((weights[k] - exact[k]).abs().max().item() for k in weights) > 1e-3  # rank-1 gradients, not the exact ones


def test_auto_says_what_it_picked_on_the_chief_only(two_replicas):
    chief, other = two_replicas[0][4], two_replicas[1][4]
    assert chief.startswith("loom: compression='auto' picked none: 0.0 MiB of fp32 gradients per step over a ") and chief.count("\n") == 1
    assert other == ""


def test_powersgd_of_rank_2_is_exact_on_gradients_of_rank_2(two_replicas):
    exact, warm, cold, bucket_per_parameter = two_replicas[0][5][0]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(exact, warm))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(exact, cold))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(exact, bucket_per_parameter))


def test_powersgd_error_feedback_sends_every_gradient_eventually(two_replicas):
    # Replica r's gradient is constant, C_r. Two plain steps apply their mean; over the next four compressed
    # ones, what was applied plus what error feedback still holds is 4 C_r.
    applied = [numerics[1] for _, _, _, _, _, numerics in two_replicas]
    assert torch.equal(applied[0], applied[1])  # both applied the same (rank-1) gradients
    mean = sum(numerics[2] for _, _, _, _, _, numerics in two_replicas) / 2
    for _, _, _, _, _, (_, summed, constant, error) in two_replicas:
        assert torch.allclose(summed + error, 2 * mean + 4 * constant, atol=1e-5)
        assert not torch.allclose(summed, 2 * mean + 4 * constant, atol=1e-2)  # compression did leave something over
