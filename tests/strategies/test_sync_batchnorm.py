"""BatchNorm statistics across replicas: global under ShardedStrategy(sync_batchnorm=True), each
replica's own between the syncs of local SGD and DiLoCo and their mean at every sync.

One two-process job answers every question; OneDevice runs in this process. MirroredStrategy's
sync_batchnorm is tested in test_data_parallel_options.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import loom
from tests.helpers import run_ranks
from tests.scripts.tp_gpt import whole

pytestmark = pytest.mark.xdist_group("sync_batchnorm")  # one launched job for the module's tests

# The synced statistics add the two replicas' sums where one device adds all samples at once.
TOLERANCE = 1e-5
STATISTICS = ("1.running_mean", "1.running_var")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def data() -> TensorDataset:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1)) * torch.tensor([1.0, 2.0, 3.0, 4.0])
    return TensorDataset(x, (x[:, 0] > 0).long())


def train(strategy: loom.Strategy) -> tuple[Any, Any]:
    """Four SGD steps on global batches of 8; returns the prepared model and the strategy."""
    prepared, opt = strategy.prepare(model(), lambda params: torch.optim.SGD(params, lr=0.1))
    step = strategy.train_step(prepared, F.cross_entropy, opt)
    for x, y in strategy.distribute(data(), batch_size=8, shuffle=False):
        step(x, y)
    return prepared, strategy


def state(prepared: nn.Module) -> dict[str, torch.Tensor]:
    return {k: whole(v) for k, v in loom.unwrap(prepared).state_dict().items()}


def _job() -> dict[str, Any]:
    found: dict[str, Any] = {
        "synced": state(train(loom.ShardedStrategy(sync_batchnorm=True, timeout=90))[0]),
        "unsynced": state(train(loom.ShardedStrategy(timeout=90))[0]),
    }
    for name, make in {"local_sgd": loom.LocalSGDStrategy, "diloco": loom.DiLoCoStrategy}.items():
        prepared, strategy = train(make(sync_every=100, timeout=90))  # no sync within the four steps
        bn = loom.unwrap(prepared)[1]
        before = {k: strategy.gather(getattr(bn, k)[None].clone()) for k in ("running_mean", "running_var")}  # every replica's
        strategy.sync()
        found[name] = {"before": before, "after": {k: getattr(bn, k).clone() for k in before}}
    return found


@pytest.fixture(scope="session")
def job() -> list[dict[str, Any]]:
    return run_ranks(_job, 2, timeout=120)


@pytest.mark.timeout(180)
def test_sharded_with_sync_batchnorm_equals_one_device_on_the_global_batch(job):
    reference = state(train(loom.OneDeviceStrategy())[0])
    untrained = model().state_dict()
    assert (reference["1.running_mean"] - untrained["1.running_mean"]).abs().max() > 0.1, "the statistics moved"
    for replica in job:
        synced = replica["synced"]
        assert synced.keys() == reference.keys()
        for key, value in reference.items():  # parameters, running statistics and the batch count
            torch.testing.assert_close(synced[key], value, rtol=TOLERANCE, atol=TOLERANCE, msg=key)
        # without the option each replica's statistics come from its own half of every batch
        assert max((replica["unsynced"][k] - reference[k]).abs().max().item() for k in STATISTICS) > 1e-2


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["local_sgd", "diloco"])
def test_local_steps_keep_each_replicas_statistics_and_a_sync_averages_them(job, name):
    first, second = (replica[name] for replica in job)
    for key, every in first["before"].items():
        assert (every[0] - every[1]).abs().max() > 1e-2, "between syncs each replica has its own"
        for replica in (first, second):
            torch.testing.assert_close(replica["after"][key], every.mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make", [loom.LocalSGDStrategy, loom.DiLoCoStrategy])
def test_local_strategies_refuse_sync_batchnorm_in_one_line(make):
    with pytest.raises(ValueError) as error:
        make(sync_batchnorm=True)
    assert str(error.value) == (
        f"{make.__name__} cannot take sync_batchnorm=True: it would all-reduce BatchNorm statistics in every forward, "
        "which the local steps avoid; drop it (each replica keeps its own statistics, averaged at every sync)"
    )
