"""Models that compute their own loss (``loss_fn=None``), and outputs that keep their class."""

from __future__ import annotations

import dataclasses
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import loom
from loom.strategies.outputs import model_logits, model_loss
from tests.contract.models import ModelOutput
from tests.helpers import run_ranks


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, :3].argmax(1)))


class AttrDict(dict):
    """A dict read by attribute, the other common output object."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclasses.dataclass(frozen=True)
class Frozen:
    logits: torch.Tensor
    loss: torch.Tensor


Pair = namedtuple("Pair", ["logits", "loss"])


class OwnLoss(nn.Module):
    """``forward(x, targets)`` computes the loss, returned in the shape ``kind`` names."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.net, self.kind = mlp(), kind

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        logits = self.net(x)
        loss = None if targets is None else F.cross_entropy(logits, targets)
        return {
            "tuple": lambda: (logits, loss),  # nanoGPT
            "hf_tuple": lambda: (loss, logits),  # Hugging Face's to_tuple()
            "model_output": lambda: ModelOutput(loss=loss, logits=logits),
            "attr_dict": lambda: AttrDict(logits=logits, loss=loss),
            "dataclass": lambda: Frozen(logits, loss),
            "namedtuple": lambda: Pair(logits, loss),
            "scalar": lambda: loss,
        }[self.kind]()


def trained(model: nn.Module, loss_fn: Any, accumulate: int = 1, precision: str = "32") -> tuple[dict[str, torch.Tensor], list[float], Any]:
    strategy = loom.OneDeviceStrategy(precision=precision)
    net, opt = strategy.prepare(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    step = strategy.train_step(net, loss_fn, opt, accumulate=accumulate)
    losses = [float(step(x, y)) for x, y in strategy.distribute(data(48), batch_size=16, shuffle=False)]
    net_weights = {k.removeprefix("net."): v.detach().clone() for k, v in loom.unwrap(net).state_dict().items()}
    return net_weights, losses, step.outputs


@pytest.mark.parametrize("kind", ["tuple", "hf_tuple", "model_output", "attr_dict", "dataclass", "namedtuple", "scalar"])
def test_train_step_takes_the_models_own_loss(kind):
    """``train_step(model, None, opt)`` calls ``model(x, y)``: the same training as the loss outside it."""
    expected, expected_losses, _ = trained(mlp(), F.cross_entropy, accumulate=2)
    got, losses, outputs = trained(OwnLoss(kind), None, accumulate=2)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value)
    assert losses == pytest.approx(expected_losses)
    if kind != "scalar":  # the outputs of both micro-batches joined, in the model's own class
        assert type(outputs).__name__ == type(OwnLoss(kind)(torch.ones(1, 6), torch.zeros(1, dtype=torch.long))).__name__
        logits = outputs[0] if kind in ("tuple", "namedtuple") else outputs[1] if kind == "hf_tuple" else outputs.logits
        assert logits.shape == (16, 3) and not logits.requires_grad


def test_fit_and_evaluate_take_the_models_own_loss():
    """50 samples in batches of 16: the uneven last batch; validation counts only the real samples.

    The accuracy metric scores the logits in each output shape.
    """
    kwargs: dict[str, Any] = dict(batch_size=16, strategy=loom.OneDeviceStrategy(), progress=False, shuffle=False, metrics=["accuracy"])
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    expected = loom.fit(mlp(), F.cross_entropy, sgd, data(50), val_data=data(21, 1), **kwargs)
    for kind in ("hf_tuple", "model_output", "dataclass", "tuple"):
        own = OwnLoss(kind)
        got = loom.fit(own, None, sgd, data(50), val_data=data(21, 1), **kwargs)
        for name in ("loss", "val_loss", "accuracy", "val_accuracy"):
            assert got[name] == pytest.approx(expected[name]), (kind, name)
    evaluated = loom.evaluate(own, None, data(21, 1), batch_size=16, strategy=loom.OneDeviceStrategy())
    assert evaluated["loss"] == pytest.approx(loom.evaluate(own.net, F.cross_entropy, data(21, 1), batch_size=16, strategy=loom.OneDeviceStrategy())["loss"])


@pytest.mark.parametrize(
    "out, line",
    [
        ((torch.ones(4, 3), torch.tensor(1.0), torch.tensor(2.0)), "output must hold exactly one scalar tensor, its loss; it holds 2"),
        ((torch.ones(4, 3), None), "output must hold exactly one scalar tensor, its loss; it holds 0"),
        (torch.ones(4), "the model's loss must be a scalar tensor (the batch mean), got (4,)"),
        ({"logits": torch.ones(4, 3)}, "computes its loss, but it returned dict: return the loss"),
    ],
)
def test_a_loss_the_step_cannot_find_is_one_line(out, line):
    with pytest.raises((TypeError, ValueError)) as error:
        model_loss(out)
    assert line in str(error.value) and "\n" not in str(error.value)


def test_logits_a_metric_cannot_find_are_one_line():
    with pytest.raises(ValueError, match=r"^a built-in metric scores the model's logits, but its tuple output does not say which they are: return \(logits, loss\)"):
        model_logits((torch.ones(4, 3), torch.ones(4, 2), torch.tensor(1.0)))


def test_dict_inputs_go_in_as_keywords_and_targets_then_belong_in_them():
    class Keywords(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> ModelOutput:
            logits = self.net(input_ids)
            return ModelOutput(loss=F.cross_entropy(logits, labels), logits=logits)

    strategy = loom.OneDeviceStrategy()
    net, opt = strategy.prepare(Keywords(), lambda p: torch.optim.SGD(p, lr=0.1))
    step = strategy.train_step(net, None, opt)
    x, y = data(8)[:]
    loss = step({"input_ids": x, "labels": y}, None)
    assert loss.dim() == 0 and isinstance(step.outputs, ModelOutput)
    with pytest.raises(ValueError, match=r"a dict of inputs is passed as model\(\*\*inputs\): put the targets in it"):
        step({"input_ids": x}, y)


@pytest.mark.parametrize("kind", ["model_output", "attr_dict", "dataclass", "namedtuple"])
def test_bf16_mixed_hands_back_the_models_output_class_in_fp32(kind):
    strategy = loom.OneDeviceStrategy(precision="bf16-mixed")
    model = strategy.prepare(OwnLoss(kind))
    out = model(torch.ones(4, 6), torch.zeros(4, dtype=torch.long))
    assert type(out) is type(OwnLoss(kind)(torch.ones(1, 6), torch.zeros(1, dtype=torch.long)))
    assert out.logits.dtype == torch.float32 and out.loss.dtype == torch.float32
    if isinstance(out, dict):
        assert out["logits"] is out.logits


STRATEGIES = {"mirrored": loom.MirroredStrategy, "tensor": loom.TensorParallelStrategy, "sharded": loom.ShardedStrategy}
KINDS = ["model_output", "attr_dict", "dataclass", "namedtuple"]


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _trained_under_each() -> dict[str, Any]:
    """On each of 2 ranks, under each strategy: the model's own loss trained; bf16 outputs' classes."""
    results = {}
    for name, make in STRATEGIES.items():
        strategy = make()
        net, opt = strategy.prepare(OwnLoss("tuple"), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
        step = strategy.train_step(net, None, opt, accumulate=2)
        for x, y in strategy.distribute(data(48), batch_size=16, shuffle=False):
            step(x, y)
        weights = {k.removeprefix("net."): _full(v.detach()).clone() for k, v in loom.unwrap(net).state_dict().items()}
        bf16 = make(precision="bf16-mixed")
        classes = {}
        for kind in KINDS:
            out = bf16.prepare(OwnLoss(kind))(torch.ones(4, 6), torch.zeros(4, dtype=torch.long))
            classes[kind] = (type(out).__name__, (out["logits"] if isinstance(out, dict) else out.logits).dtype == torch.float32)
        results[name] = {"weights": weights, "classes": classes}
    return results


def test_each_strategy_takes_the_models_own_loss_and_keeps_its_output_class():
    """Mirrored, TensorParallel and Sharded on 2 ranks (one job) against OneDevice."""
    expected, _, _ = trained(mlp(), F.cross_entropy, accumulate=2)
    classes = {kind: (type(OwnLoss(kind)(torch.ones(1, 6), torch.zeros(1, dtype=torch.long))).__name__, True) for kind in KINDS}
    for rank in run_ranks(_trained_under_each, 2, timeout=180):
        for name, got in rank.items():
            for key, value in expected.items():
                torch.testing.assert_close(got["weights"][key], value, msg=lambda m: f"{name} {key}: {m}")
            assert got["classes"] == classes, (name, got["classes"])
