"""Keras' fit arguments, loom.predict and Keras' callbacks on loom.fit."""

import csv

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import loom
from loom.train import Callback, CSVLogger, LearningRateScheduler, ModelCheckpoint, ReduceLROnPlateau
from tests.helpers import run_ranks
from tests.scripts.fit_job import data


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))


def sgd(p):
    return torch.optim.SGD(p, lr=0.2, momentum=0.9)


def one():
    """A fresh strategy per call, so no test inherits another's state."""
    return {"strategy": loom.OneDeviceStrategy(), "progress": False}


class Record(Callback):
    """What each hook saw: the epoch and learning rate at each training batch, the test batches."""

    def __init__(self):
        self.batches, self.test_batches, self.test_ends = [], [], []

    def on_batch_begin(self, state):
        self.batches.append((state.epoch, state.optimizer.param_groups[0]["lr"]))

    def on_test_batch_begin(self, state, batch):
        self.test_batches.append(batch)

    def on_test_end(self, state, logs):
        self.test_ends.append(dict(logs))


def test_steps_per_epoch_cuts_the_repeated_data_into_epochs():
    """4 epochs of 3 steps over 4 batches a pass train exactly as 3 passes (each reshuffled) do."""
    cut, whole = model(), model()
    history = loom.fit(cut, F.cross_entropy, sgd, data(64, 0), epochs=4, steps_per_epoch=3, batch_size=16, **one())
    loom.fit(whole, F.cross_entropy, sgd, data(64, 0), epochs=3, batch_size=16, **one())
    assert len(history["loss"]) == 4
    for a, b in zip(cut.parameters(), whole.parameters()):
        assert torch.equal(a, b)


def test_steps_per_epoch_resumes_in_the_middle_and_at_the_end_of_a_pass(tmp_path):
    """Epochs of 2 steps over 4 batches a pass: resumed after epoch 1 (mid-pass) and 2 (pass ended), as one run."""
    def run(epochs, directory):
        net = model()
        loom.fit(net, F.cross_entropy, sgd, data(64, 0), epochs=epochs, steps_per_epoch=2, batch_size=16, checkpoint_dir=directory, **one())
        return net

    straight = run(3, tmp_path / "straight")
    for epochs in (1, 2, 3):
        resumed = run(epochs, tmp_path / "resumed")
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="the training data has no batches: steps_per_epoch needs data to repeat"):
        loom.fit(model(), F.cross_entropy, sgd, [], epochs=1, steps_per_epoch=2, batch_size=16, **one())


def test_validation_steps_freq_initial_epoch_and_test_hooks():
    record = Record()
    history = loom.fit(model(), F.cross_entropy, sgd, data(64, 0), val_data=data(50, 1), epochs=5, initial_epoch=1, batch_size=16,
                       validation_freq=2, validation_steps=2, callbacks=[record], **one())  # fmt: skip
    assert sorted({epoch for epoch, _ in record.batches}) == [1, 2, 3, 4] and len(record.batches) == 16
    assert len(history["loss"]) == 4 and len(history["val_loss"]) == 2  # epochs 2 and 4 (1-based) validate
    assert record.test_batches == [0, 1, 0, 1]  # two batches each time, from the start
    assert record.test_ends[-1]["val_loss"] == history["val_loss"][-1]
    listed = loom.fit(model(), F.cross_entropy, sgd, data(64, 0), val_data=data(50, 1), epochs=3, batch_size=16, validation_freq=[1, 3], **one())
    assert len(listed["val_loss"]) == 2


def test_evaluate_steps_reads_the_first_batches_and_calls_the_test_hooks():
    net, record = model(), Record()
    x, y = data(50, 1).tensors
    first = loom.evaluate(net, F.cross_entropy, data(50, 1), batch_size=16, steps=2, callbacks=[record], strategy=loom.OneDeviceStrategy())
    assert first["loss"] == pytest.approx(F.cross_entropy(net(x[:32]), y[:32]).item(), rel=1e-5)
    assert record.test_batches == [0, 1] and record.test_ends == [first]


def regression():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(101, 6, generator=g)
    return TensorDataset(x, 2 * x[:, 0] - x[:, 1])


def linear():
    torch.manual_seed(1)
    return nn.Linear(6, 1)


def weighted_auroc():
    import torchmetrics

    return torchmetrics.AUROC(task="multiclass", num_classes=2, average="weighted")


def _on_two_replicas():
    """One job for the assertions on replicas: predict, and torchmetrics metrics over uneven data."""
    strategy = loom.MirroredStrategy()
    x, _ = data(101, 1).tensors
    predicted = loom.predict(model(), data(101, 1), batch_size=40, strategy=strategy), loom.predict(model(), x, batch_size=40, strategy=strategy)
    classes = loom.evaluate(model(), F.cross_entropy, data(101, 1), batch_size=40, strategy=strategy,
                            metrics={"precision": "precision", "recall": "recall", "f1": "f1", "auroc": "auroc", "weighted": weighted_auroc()})  # fmt: skip
    values = loom.evaluate(linear(), lambda out, y: F.mse_loss(out.squeeze(1), y), regression(), batch_size=40, strategy=strategy, metrics=["mae", "mse"])
    return predicted, classes, values


def test_on_two_replicas_predict_gives_each_sample_once_in_order_and_torchmetrics_count_each_sample_once():
    """101 samples in global batches of 40: the last batch is split 11 + 10 (and one padded); one process is the reference."""
    import torchmetrics

    x, y = data(101, 1).tensors
    rx, ry = regression().tensors
    with torch.no_grad():
        expected, guessed = model()(x), linear()(rx).squeeze(1)
    reference = {
        "precision": torchmetrics.Precision(task="multiclass", num_classes=2, average="macro")(expected, y),
        "recall": torchmetrics.Recall(task="multiclass", num_classes=2, average="macro")(expected, y),
        "f1": torchmetrics.F1Score(task="multiclass", num_classes=2, average="macro")(expected, y),
        "auroc": torchmetrics.AUROC(task="multiclass", num_classes=2, average="macro")(expected, y),
        "weighted": weighted_auroc()(expected, y),
    }
    for (from_pairs, from_tensor), classes, values in run_ranks(_on_two_replicas, 2, timeout=150):
        torch.testing.assert_close(from_pairs, expected)
        torch.testing.assert_close(from_tensor, expected)
        for name, value in reference.items():
            assert classes[name] == pytest.approx(float(value), abs=1e-6), name
        assert values["mae"] == pytest.approx(float((guessed - ry).abs().mean()), rel=1e-5)
        assert values["mse"] == pytest.approx(float(((guessed - ry) ** 2).mean()), rel=1e-5)
    torch.testing.assert_close(loom.predict(model(), x, batch_size=40, strategy=loom.OneDeviceStrategy()), expected)


def test_fit_reports_torchmetrics_and_refuses_an_unsynced_one():
    import torchmetrics

    history = loom.fit(model(), F.cross_entropy, sgd, data(64, 0), val_data=data(50, 1), epochs=2, batch_size=16,
                       metrics=["f1", torchmetrics.Accuracy(task="multiclass", num_classes=2)], **one())  # fmt: skip
    assert {"f1", "val_f1", "MulticlassAccuracy", "val_MulticlassAccuracy"} <= set(history) and len(history["val_f1"]) == 2
    with pytest.raises(ValueError, match="loom syncs BinaryAUROC over the replicas: create it without sync_on_compute=False"):
        loom.fit(model(), F.cross_entropy, sgd, data(64, 0), batch_size=16, metrics=[torchmetrics.AUROC(task="binary", sync_on_compute=False)], **one())


def test_model_checkpoint_keeps_the_best_epochs(tmp_path):
    history = loom.fit(model(), F.cross_entropy, lambda p: torch.optim.SGD(p, lr=2.0), data(64, 0), val_data=data(50, 1), epochs=5, batch_size=16,
                       callbacks=[ModelCheckpoint(tmp_path, monitor="val_accuracy", save_best_only=True, keep=10)],
                       metrics=["accuracy"], **one())  # fmt: skip
    scores = history["val_accuracy"]
    best = [e for e, v in enumerate(scores) if v > max(scores[:e], default=-1.0)]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [f"step-{4 * (e + 1):08d}" for e in best]
    restored = loom.OneDeviceStrategy().restore(tmp_path, model=model())
    assert restored["epoch"] == best[-1] + 1 and restored["history"]["val_accuracy"][-1] == max(scores)


def test_csv_logger_learning_rate_scheduler_and_reduce_on_plateau(tmp_path):
    """A flat loss never improves: Keras' patience 2 halves the LR at the 2nd and 4th epochs without progress."""
    flat = TensorDataset(torch.zeros(16, 6), torch.zeros(16, dtype=torch.long))

    def no_loss(outputs, targets):
        return (outputs * 0).sum()

    record, path = Record(), tmp_path / "log.csv"
    loom.fit(model(), no_loss, lambda p: torch.optim.SGD(p, lr=1.0), flat, val_data=flat, epochs=6, batch_size=16, validation_freq=[2, 3, 4, 5, 6],
             callbacks=[ReduceLROnPlateau(factor=0.5, patience=2), CSVLogger(path), record], **one())  # fmt: skip
    assert [lr for _, lr in record.batches] == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5]  # val from epoch 2: best, then 3 and 4 bad
    rows = list(csv.DictReader(path.open()))
    assert [row["epoch"] for row in rows] == ["0", "1", "2", "3", "4", "5"] and rows[0]["val_loss"] == "NA" and rows[1]["val_loss"] == "0.0"
    record = Record()
    loom.fit(model(), no_loss, lambda p: torch.optim.SGD(p, lr=1.0), flat, epochs=3, batch_size=16,
             callbacks=[LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5**epoch), record], **one())  # fmt: skip
    assert [lr for _, lr in record.batches] == [0.1, 0.05, 0.025]
    with pytest.raises(ValueError, match="LearningRateScheduler sets the learning rate each epoch, and fit's scheduler= each update: pass one of them"):
        loom.fit(model(), no_loss, lambda p: torch.optim.SGD(p, lr=1.0), flat, epochs=1, batch_size=16, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1),
                 callbacks=[LearningRateScheduler(lambda epoch, lr: lr)], **one())  # fmt: skip


def test_auto_mode_maximises_scores_and_minimises_errors():
    from loom.train.callbacks import _Monitor

    modes = {name: _Monitor("ModelCheckpoint", name, "auto").mode for name in ("val_loss", "val_MulticlassAccuracy", "val_auroc", "f1", "mae")}
    assert modes == {"val_loss": "min", "val_MulticlassAccuracy": "max", "val_auroc": "max", "f1": "max", "mae": "min"}
    with pytest.raises(ValueError, match="mode must be 'min', 'max' or 'auto', got 'best'"):
        ModelCheckpoint("unused", mode="best")
