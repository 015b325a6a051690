"""tf.distribute's names with TF's meaning; the ones loom does not provide name loom's way in one line."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import loom
from loom import ReduceOp
from tests.helpers import run_ranks

GLOBAL_BATCH = 8


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))


def _net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _train(strategy, under_scope: bool) -> dict[str, torch.Tensor]:
    if under_scope:
        with strategy.scope():
            net = _net()
    else:
        net = _net()
    model, opt = strategy.prepare(net, lambda p: torch.optim.SGD(p, lr=0.1))
    for x, y in strategy.experimental_distribute_dataset(DataLoader(_data(), batch_size=GLOBAL_BATCH, shuffle=False)):
        strategy.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in loom.unwrap(model).state_dict().items()}


def _first_gradient(strategy, loss_of) -> torch.Tensor:
    """The first layer's weight gradient after one global batch, with the loss ``loss_of(per_example, strategy)``."""
    model = strategy.prepare(_net())
    x, y = next(iter(strategy.distribute(_data(), batch_size=GLOBAL_BATCH, shuffle=False)))
    strategy.backward(loss_of(((model(x) - y) ** 2).flatten(), strategy))
    return loom.unwrap(model)[0].weight.grad.clone()


def _job() -> dict:
    strategy = loom.MirroredStrategy(timeout=90)
    rank = strategy.replica_id
    found = {
        "run": strategy.run(lambda a, b=0: a * 10 + b, args=(rank,), kwargs={"b": 1}),
        "local_results": strategy.experimental_local_results(torch.tensor(rank)),
        "sum": strategy.reduce("SUM", torch.tensor(float(rank + 1)), axis=None).item(),
        "mean_axis": strategy.reduce(ReduceOp.MEAN, torch.tensor([rank, rank + 2.0]), axis=0).item(),
        "sum_axis": strategy.reduce(ReduceOp.SUM, torch.tensor([rank, 1.0]), axis=0).item(),
    }
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.get_per_replica_batch_size(GLOBAL_BATCH)))
        x, y = _data().tensors
        return DataLoader(TensorDataset(x[ctx.input_pipeline_id :: ctx.num_input_pipelines], y[ctx.input_pipeline_id :: ctx.num_input_pipelines]),
                          batch_size=ctx.get_per_replica_batch_size(GLOBAL_BATCH))  # fmt: skip

    batches = strategy.distribute_datasets_from_function(dataset_fn)
    found["from_function"] = (contexts, [x[:, 0].tolist() for x, _ in batches][:1], len(list(batches)))
    found["scope"] = (_train(strategy, True), _train(strategy, False))
    found["loom_loss"] = _first_gradient(strategy, lambda l, s: loom.compute_average_loss(l, GLOBAL_BATCH, strategy=s))
    found["tf_loss"] = _first_gradient(strategy, lambda l, s: l.sum() / GLOBAL_BATCH)  # TF's convention, unchanged
    return found


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_job, 2, timeout=120)


def test_run_and_local_results_are_this_replicas(ranks):
    assert [r["run"] for r in ranks] == [1, 11]  # every process runs fn, on its own values
    assert [r["local_results"] for r in ranks] == [(torch.tensor(0),), (torch.tensor(1),)]


def test_reduce_takes_tf_order_names_and_axis(ranks):
    assert [r["sum"] for r in ranks] == [3.0, 3.0]
    assert [r["mean_axis"] for r in ranks] == [1.5, 1.5]  # mean of [0, 2, 1, 3]
    assert [r["sum_axis"] for r in ranks] == [3.0, 3.0]  # 0 + 1 + 1 + 1


def test_datasets_from_function_get_an_input_context(ranks):
    x = _data().tensors[0]
    for rank, found in enumerate(ranks):
        contexts, first, count = found["from_function"]
        assert contexts == [(2, rank, GLOBAL_BATCH // 2)]
        assert first == [x[rank : GLOBAL_BATCH : 2, 0].tolist()]
        assert count == 32 // GLOBAL_BATCH  # iterable again, for the next epoch


def test_a_model_built_under_scope_trains_the_same(ranks):
    reference = _train(loom.OneDeviceStrategy(), under_scope=False)
    for found in ranks:
        under, outside = found["scope"]
        for k in reference:
            assert torch.equal(under[k], outside[k])
            assert torch.allclose(under[k], reference[k], atol=1e-6)


def test_compute_average_loss_gives_one_devices_gradient_and_tfs_division_does_not(ranks):
    one = _first_gradient(loom.OneDeviceStrategy(), lambda l, s: l.mean())
    for found in ranks:
        assert torch.allclose(found["loom_loss"], one, atol=1e-6)
        assert torch.allclose(found["tf_loss"] * 2, one, atol=1e-6)  # TF's sum / global batch: N times too small


@pytest.mark.parametrize(
    "name, line",
    [
        ("experimental_run_v2", "no tf.distribute 'experimental_run_v2': in loom use strategy.run"),
        ("extended", "in loom use the strategy's own options"),
        ("experimental_make_numpy_dataset", r"strategy.distribute\(torch.utils.data.TensorDataset"),
    ],
)
def test_tf_names_not_provided_say_what_to_use(name, line):
    strategy = loom.OneDeviceStrategy()
    with pytest.raises(AttributeError, match=line) as raised:
        getattr(strategy, name)
    assert "\n" not in str(raised.value)
    assert not hasattr(strategy, "no_such_thing")


def test_one_device_takes_the_same_names():
    strategy = loom.OneDeviceStrategy()
    assert strategy.reduce(ReduceOp.SUM, torch.tensor([[1.0, 2.0]]), axis=1).tolist() == [3.0]
    assert strategy.run(torch.add, args=(torch.ones(1), 1)).item() == 2.0
    with pytest.raises(TypeError, match="for a Dataset use strategy.distribute"):
        strategy.experimental_distribute_dataset(_data())
    with pytest.raises(ValueError, match="global batch 9 does not split over 2 replicas"):
        loom.InputContext(2, 0, 2).get_per_replica_batch_size(9)
    with pytest.raises(ValueError, match="needs strategy="):
        loom.compute_average_loss(torch.ones(4), global_batch_size=8)


@pytest.mark.parametrize("keras, ours", [("mixed_bfloat16", "bf16-mixed"), ("mixed_float16", "16-mixed"), ("float32", "32")])
def test_keras_precision_names_are_aliases(keras, ours):
    a, b = loom.OneDeviceStrategy(precision=keras).precision, loom.OneDeviceStrategy(precision=ours).precision
    assert (a.name, a.dtype, a.scaler is None) == (b.name, b.dtype, b.scaler is None)
