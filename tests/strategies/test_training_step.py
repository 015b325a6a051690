"""Mixed precision, clipping and scheduling in one process: the set-ups that trained silently wrong."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loom
from loom.strategies.parameter_server.strategy import ParameterServerStrategy
from tests.scripts.clicks import Clicks
from tests.strategies.parameter_server.test_strategy import batches, servers  # noqa: F401 - a fixture


def _linear(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(4, 1)


def test_two_optimizers_under_fp16_each_update_at_its_true_size():
    """The first optimizer's gradients overflow and its step is skipped; the second's must not
    be unscaled by a scale that the first one's update already halved (it came out 2x)."""
    strategy = loom.OneDeviceStrategy(precision="16-mixed")
    a, b = _linear(0), _linear(1)
    model_a, opt_a = strategy.prepare(a, lambda p: torch.optim.SGD(p, lr=1e-3))
    model_b, opt_b = strategy.prepare(b, lambda p: torch.optim.SGD(p, lr=1e-3))
    x = torch.rand(8, 4) * 0.1  # b's scaled gradient stays finite
    before = b.weight.detach().clone()
    loss = model_a(torch.full((8, 4), 6e4)).pow(2).mean() + model_b(x).mean() / 2  # a's gradient overflows fp16, b's not
    strategy.backward(loss)
    scale = opt_b.scaler.get_scale()
    gradient = b.weight.grad / scale
    opt_a.step()
    opt_b.step()
    torch.testing.assert_close(before - b.weight.detach(), 1e-3 * gradient)
    assert opt_a.scaler.get_scale() == scale / 2  # the next iteration's scale, halved for the inf
    strategy.backward(model_b(x).mean())  # where the update runs, once
    assert opt_a.scaler.get_scale() == scale / 2


def test_clipping_after_unscaling_unscales_once():
    """``opt.scaler.unscale_(opt)``, clip, ``opt.step()``: the step must not unscale a second time."""
    strategy = loom.OneDeviceStrategy(precision="16-mixed")
    net = _linear(0)
    model, opt = strategy.prepare(net, lambda p: torch.optim.SGD(p, lr=1e-3))
    before = net.weight.detach().clone()
    strategy.backward(model(torch.full((8, 4), 0.25)).mean() / 2)  # x 65536 stays finite in fp16
    opt.scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(net.parameters(), 100.0)  # far above the norm: changes nothing
    gradient = net.weight.grad.clone()
    opt.step()
    torch.testing.assert_close(before - net.weight.detach(), 1e-3 * gradient)
    assert gradient.abs().max() > 0.1  # the true gradient (0.125), not one divided by the scale again


def test_clip_gradients_unscales_clips_and_acts_only_when_the_update_comes():
    strategy = loom.OneDeviceStrategy(precision="16-mixed")
    net = _linear(0)
    model, opt = strategy.prepare(net, lambda p: torch.optim.SGD(p, lr=1.0))
    with strategy.accumulate(2):
        strategy.backward(model(torch.ones(8, 4)).mean())
        assert not strategy.sync_gradients and strategy.clip_gradients(opt, 0.1) is None
        strategy.backward(model(torch.ones(8, 4)).mean())
        assert strategy.sync_gradients
        norm = strategy.clip_gradients(opt, 0.1)
        assert norm == pytest.approx(5**0.5, rel=1e-3)  # d(mean)/dw = 1 for 4 weights and the bias: sqrt(5)
        clipped = torch.cat([p.grad.flatten() for p in net.parameters()]).norm()
        assert clipped == pytest.approx(0.1, rel=1e-3)


def test_train_step_refuses_to_run_inside_accumulate():
    strategy = loom.OneDeviceStrategy()
    model, opt = strategy.prepare(_linear(0), lambda p: torch.optim.SGD(p, lr=0.1))
    step = strategy.train_step(model, F.mse_loss, opt)
    with strategy.accumulate(2), pytest.raises(RuntimeError, match=r"pass accumulate=k to train_step\(\) instead"):
        step(torch.ones(2, 4), torch.ones(2, 1))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"accumulate": 0}, "train_step\\(accumulate=...\\) takes a positive number of micro-batches, got 0"),
        ({"max_grad_norm": -1.0}, "max_grad_norm must be a positive number, got -1.0"),
        ({"scheduler": 0.5}, "scheduler must be an LR scheduler \\(with .step\\(\\)\\), not float"),
    ],
)
def test_bad_train_step_options(options, message):
    strategy = loom.OneDeviceStrategy()
    model, opt = strategy.prepare(_linear(0), lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises((ValueError, TypeError), match=message):
        strategy.train_step(model, F.mse_loss, opt, **options)


def test_train_step_with_a_scheduler_steps_it_once_per_update_and_returns_a_lazy_loss():
    strategy = loom.OneDeviceStrategy()
    model, opt = strategy.prepare(_linear(0), lambda p: torch.optim.SGD(p, lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step = strategy.train_step(model, F.mse_loss, opt, scheduler=scheduler, accumulate=4)
    loss = step(torch.ones(8, 4), torch.zeros(8, 1))
    assert opt.param_groups[0]["lr"] == 0.5  # one update of 4 micro-batches: one scheduler step (was 0.0625)
    assert isinstance(loss, torch.Tensor) and not loss.requires_grad and step.outputs.shape == (8, 1)


def test_unwrap_and_checkpoint_keys_ignore_compile_and_precision(tmp_path):
    """A compiled bf16 model saves under its own keys and restores into a plain model."""
    strategy = loom.OneDeviceStrategy(precision="bf16-mixed")
    net = _linear(0)
    compiled = torch.compile(strategy.prepare(net), backend="eager")
    assert loom.unwrap(compiled) is net
    strategy.save(tmp_path, step=1, model=compiled)
    plain = _linear(5)
    loom.OneDeviceStrategy().restore(tmp_path, model=plain)
    assert torch.equal(plain.weight, net.weight)


def test_print_is_the_chiefs(capsys, monkeypatch):
    strategy = loom.OneDeviceStrategy()
    strategy.print("hello", 1)
    monkeypatch.setattr(loom.OneDeviceStrategy, "replica_id", property(lambda self: 1))
    strategy.print("not me")
    assert capsys.readouterr().out == "hello 1\n"


def _fp16_run(strategy, model, opt, steps, start=0):
    step = strategy.train_step(model, F.mse_loss, opt)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g) * (1e3 if k == 1 else 1), torch.randn(8, 1, generator=g)) for k in range(6)]
    for x, y in batches[start : start + steps]:  # batch 1's gradients overflow fp16: the scale halves
        step(x, y)


def test_a_resumed_fp16_run_equals_an_uninterrupted_one(tmp_path):
    """The gradient scaler's state is saved with the optimizer (its scale went 32768 -> 65536 on restore)."""
    strategy = loom.OneDeviceStrategy(precision="16-mixed")
    net = _linear(0)
    model, opt = strategy.prepare(net, lambda p: torch.optim.Adam(p, lr=1e-2))
    _fp16_run(strategy, model, opt, 3)
    strategy.save(tmp_path, step=3, model=model, optimizer=opt)
    scale = opt.scaler.get_scale()
    assert scale < 65536.0
    _fp16_run(strategy, model, opt, 3, start=3)

    resumed = loom.OneDeviceStrategy(precision="16-mixed")
    again = _linear(7)
    model2, opt2 = resumed.prepare(again, lambda p: torch.optim.Adam(p, lr=1e-2))
    resumed.restore(tmp_path, model=model2, optimizer=opt2)
    assert opt2.scaler.get_scale() == scale
    _fp16_run(resumed, model2, opt2, 3, start=3)
    assert torch.equal(again.weight, net.weight) and opt2.scaler.get_scale() == opt.scaler.get_scale()


def test_fp16_with_an_optimizer_the_user_built():
    """train_step unscales an optimizer prepare() did not wrap; the eager loop refuses it in one line."""
    strategy = loom.OneDeviceStrategy(precision="16-mixed")
    net, reference = _linear(0), _linear(0)
    model = strategy.prepare(net)
    step = strategy.train_step(model, F.mse_loss, torch.optim.SGD(net.parameters(), lr=0.1), max_grad_norm=10.0)
    prepared = loom.OneDeviceStrategy(precision="16-mixed")
    ref_model, ref_opt = prepared.prepare(reference, lambda p: torch.optim.SGD(p, lr=0.1))
    ref_step = prepared.train_step(ref_model, F.mse_loss, ref_opt, max_grad_norm=10.0)
    for _ in range(3):
        x, y = torch.rand(8, 4), torch.rand(8, 1)
        step(x, y)
        ref_step(x, y)
    assert torch.isfinite(net.weight).all() and torch.equal(net.weight, reference.weight)
    bare = loom.OneDeviceStrategy(precision="16-mixed")
    with pytest.raises(RuntimeError, match="precision='16-mixed' scales the loss, so the optimizer must unscale it: pass the optimizer to strategy.prepare"):
        bare.backward(bare.prepare(_linear(0))(torch.ones(2, 4)).sum())


def test_accumulate_refuses_a_second_optimizer_in_its_cycle():
    strategy = loom.OneDeviceStrategy()
    d, opt_d = strategy.prepare(_linear(0), lambda p: torch.optim.SGD(p, lr=0.1))
    g, opt_g = strategy.prepare(_linear(1), lambda p: torch.optim.SGD(p, lr=0.1))
    with strategy.accumulate(2), pytest.raises(RuntimeError, match="accumulate\\(\\) counts one backward per micro-batch"):
        for model, opt in ((d, opt_d), (g, opt_g)):
            strategy.backward(model(torch.ones(2, 4)).sum())
            opt.step()


def test_train_step_outputs_own_losses_and_short_last_batches():
    """Dict outputs with a scalar, no targets (the model computes its loss), a batch smaller than accumulate."""
    class Scored(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _linear(0)

        def forward(self, x):
            pred = self.net(x)
            return {"pred": pred, "loss": pred.pow(2).mean()}

    strategy = loom.OneDeviceStrategy()
    model, opt = strategy.prepare(Scored(), lambda p: torch.optim.SGD(p, lr=0.1))
    step = strategy.train_step(model, lambda out, _: out["loss"], opt, accumulate=4)
    step(torch.ones(8, 4), None)
    assert step.outputs["pred"].shape == (8, 1) and step.outputs["loss"].dim() == 0
    step(torch.ones(2, 4), None)  # 2 samples, accumulate=4: two micro-batches
    assert step.outputs["pred"].shape == (2, 1)


def test_fit_and_evaluate_with_a_model_that_returns_a_dict():
    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model()

        def forward(self, x):
            return {"logits": self.net(x)}

    from tests.scripts.fit_job import data

    def loss(out, y):
        return F.cross_entropy(out["logits"], y)

    def correct(out, y):
        return (out["logits"].argmax(1) == y).float()

    history = loom.fit(Named(), loss, lambda p: torch.optim.SGD(p, lr=0.1), data(50, 0), val_data=data(21, 1), batch_size=8,
                       metrics={"accuracy": correct}, strategy=loom.OneDeviceStrategy(), progress=False)  # fmt: skip
    assert 0 <= history["val_accuracy"][0] <= 1
    result = loom.evaluate(Named(), loss, data(21, 1), batch_size=8, metrics={"accuracy": correct}, strategy=loom.OneDeviceStrategy())
    assert set(result) == {"loss", "accuracy"}


def test_fit_refuses_a_scheduler_that_needs_a_metric():
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau needs a metric: pass callbacks=\[loom.train.ReduceLROnPlateau"):
        loom.fit(_linear(0), F.mse_loss, lambda p: torch.optim.SGD(p, lr=0.1), torch.utils.data.TensorDataset(torch.ones(4, 4), torch.ones(4, 1)),
                 batch_size=2, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau, strategy=loom.OneDeviceStrategy(), progress=False)  # fmt: skip


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))


def _eager_cycle(schedule_every_micro_batch: bool) -> list[warnings.WarningMessage]:
    strategy = loom.OneDeviceStrategy()
    model, opt = strategy.prepare(_linear(0), lambda p: torch.optim.SGD(p, lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings(record=True) as caught, strategy.accumulate(2):
        warnings.simplefilter("always")
        for _ in range(4):
            strategy.backward(model(torch.ones(2, 4)).mean())
            opt.step()
            opt.zero_grad()
            if schedule_every_micro_batch or strategy.sync_gradients:
                scheduler.step()
    return [w for w in caught if "learning rate" in str(w.message)]


def test_a_scheduler_stepped_every_micro_batch_is_warned_about_once():
    warned = _eager_cycle(schedule_every_micro_batch=True)
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert "step it only when strategy.sync_gradients is True" in str(warned[0].message)
    assert _eager_cycle(schedule_every_micro_batch=False) == []


def test_get_scale_right_after_step_is_the_updated_one():
    """torch users log the scale after ``opt.step()``: an overflow must show there, halved, and
    the update still run once."""
    strategy = loom.OneDeviceStrategy(precision="16-mixed")
    model, opt = strategy.prepare(_linear(0), lambda p: torch.optim.SGD(p, lr=1e-3))
    before = opt.scaler.get_scale()
    strategy.backward(model(torch.full((8, 4), 6e4)).pow(2).mean())  # overflows fp16
    opt.step()
    assert opt.scaler.get_scale() == before / 2
    strategy.backward(model(torch.ones(8, 4)).mean())  # the due update runs here, once
    assert opt.scaler.get_scale() == before / 2


def test_parameter_server_optimizer_runs_step_hooks_as_torchs_do(servers):
    strategy = ParameterServerStrategy(servers, token="job-token", worker=0, num_workers=1)
    remote, opt = strategy.prepare(Clicks(), lambda p: torch.optim.SGD(p, lr=0.1))
    calls: list[str] = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    ids, y = next(iter(batches(1)))
    for _ in range(2):
        F.binary_cross_entropy_with_logits(remote(ids), y).backward()
        opt.step()
        opt.zero_grad()
        pre.remove()
    strategy.shutdown()
    assert calls == ["pre", "post", "post"]
