import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import loom
from loom.train import Callback, EarlyStopping
from tests.helpers import SCRIPTS, loom_run
from tests.scripts.fit_job import data


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))


def test_fit_learns_and_reports_every_epoch(capsys):
    history = loom.fit(model(), F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9), data(400, 0),
                       val_data=data(101, 1), epochs=3, batch_size=40, metrics=["accuracy"], strategy=loom.OneDeviceStrategy())  # fmt: skip
    assert set(history) == {"loss", "accuracy", "val_loss", "val_accuracy", "samples_per_sec"}
    assert len(history["loss"]) == 3 and history["loss"][-1] < history["loss"][0]
    assert history["val_accuracy"][-1] > 0.9
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("epoch 1/3  loss ") and "val_accuracy" in printed[0] and "samples/s" in printed[0]


def test_evaluate_counts_each_sample_once():
    net = model()
    x, y = data(101, 1).tensors
    expected_loss = F.cross_entropy(net(x), y).item()
    expected_acc = (net(x).argmax(1) == y).float().mean().item()
    result = loom.evaluate(net, F.cross_entropy, data(101, 1), batch_size=40, strategy=loom.OneDeviceStrategy(), metrics=["accuracy"])
    assert result["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert result["accuracy"] == pytest.approx(expected_acc)


def test_early_stopping_and_custom_callbacks():
    class Count(Callback):
        epochs = 0

        def on_epoch_end(self, state, logs):
            Count.epochs += 1

    flat = TensorDataset(torch.zeros(32, 6), torch.zeros(32, dtype=torch.long))
    loom.fit(model(), F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.0), flat, val_data=flat, epochs=20, batch_size=8,
             strategy=loom.OneDeviceStrategy(), callbacks=[EarlyStopping("val_loss", patience=2), Count()], progress=False)  # fmt: skip
    assert Count.epochs == 3  # best at epoch 1, no improvement in 2 and 3
    with pytest.raises(KeyError, match="EarlyStopping monitors 'val_acc', but the logs hold only loss"):
        loom.fit(model(), F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.1), flat, epochs=1, batch_size=8,
                 strategy=loom.OneDeviceStrategy(), callbacks=[EarlyStopping("val_acc")], progress=False)  # fmt: skip


def test_unknown_metric():
    with pytest.raises(ValueError, match="unknown metric 'f2'; use one of accuracy, precision, recall, f1, auroc, mae, mse, a function or a torchmetrics.Metric"):
        loom.fit(model(), F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.1), data(8, 0), batch_size=8, metrics=["f2"],
                 strategy=loom.OneDeviceStrategy())  # fmt: skip


def test_fit_on_two_replicas_matches_one_and_only_the_chief_writes(tmp_path):
    out, logs = tmp_path / "history", tmp_path / "tb"
    done = loom_run(["run", "--nproc", "2", "--timeout", "60", str(SCRIPTS / "fit_job.py"), str(out), str(logs)], timeout=120)
    assert done.returncode == 0, done.stderr
    first, second = (json.loads((tmp_path / f"history.{r}.json").read_text()) for r in (0, 1))
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert first[key] == second[key]  # logs are reduced: every replica sees the same numbers
    assert len(list(logs.glob("events.out.tfevents.*"))) == 1
    assert done.stdout.count("epoch 1/3") == 1  # the chief prints, the other replica does not
    alone = loom.fit(model(), F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9), data(400, 0),
                     val_data=data(101, 1), epochs=3, batch_size=40, metrics=["accuracy"], strategy=loom.OneDeviceStrategy(), progress=False)  # fmt: skip
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert first[key] == pytest.approx(alone[key], abs=1e-5)


def test_fit_trains_on_a_pipeline_and_prints_the_input_report_when_input_bound(capsys):
    import time

    import loom.data as ld

    def slow(row):
        time.sleep(0.002)  # input far slower than the step: input-bound
        return row

    x, y = data(400, 0).tensors
    pipeline = ld.from_tensors(x, y).shuffle(seed=0).map(slow, num_parallel=1).batch(40)
    history = loom.fit(model(), F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9), pipeline,
                       epochs=2, strategy=loom.OneDeviceStrategy())  # fmt: skip
    assert len(history["loss"]) == 2 and history["loss"][-1] < history["loss"][0]
    out = capsys.readouterr().out
    assert "verdict: input-bound, slowest stage 'slow'" in out


def test_fit_steps_its_scheduler_per_update_clips_and_resumes_it(tmp_path):
    """A scheduler factory steps once per update (with accumulation too) and is saved with the checkpoints."""
    def run(epochs, directory):
        net = model()
        loom.fit(net, F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.1), data(64, 0), epochs=epochs, batch_size=16,
                 scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), accumulate=2,
                 max_grad_norm=0.5, strategy=loom.OneDeviceStrategy(), progress=False, checkpoint_dir=directory)  # fmt: skip
        return net

    straight = run(2, tmp_path / "straight")
    run(1, tmp_path / "resumed")
    resumed = run(2, tmp_path / "resumed")
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    assert (tmp_path / "straight" / "step-00000008").is_dir()  # 64 samples / 16, two epochs: 8 updates
