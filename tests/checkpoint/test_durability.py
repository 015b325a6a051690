"""A save changes nothing it saves, a committed checkpoint is never lost to the next save, and a
restore refuses what it cannot read: one process, no launcher."""

import json
import os
import signal
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loom
from loom.checkpoint import committed, layout
from loom.comm import preemption
from loom.errors import CheckpointMismatchError
from tests.checkpoint.tamper import recommit
from tests.helpers import job_env, run
from tests.scripts.fit_job import data


def _adam(seed=0):
    torch.manual_seed(seed)
    strategy = loom.OneDeviceStrategy()
    model, opt = strategy.prepare(nn.Linear(4, 3), lambda p: torch.optim.Adam(p, lr=0.1))
    return strategy, model, opt


def _train(strategy, model, opt, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        strategy.backward(model(torch.randn(8, 4, generator=g)).square().mean())
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_a_save_before_the_first_step_changes_nothing_and_restores_as_a_fresh_optimizer(tmp_path):
    reference = _train(*_adam())

    strategy, model, opt = _adam()
    strategy.save(tmp_path, step=0, model=model, optimizer=opt)
    assert not opt.optimizer.state, "saving created optimizer state"
    assert all(torch.equal(a, b) for a, b in zip(reference, _train(strategy, model, opt)))

    fresh, fresh_model, fresh_opt = _adam(seed=5)  # other weights: the restore must overwrite them
    fresh.restore(tmp_path, model=fresh_model, optimizer=fresh_opt)
    assert not fresh_opt.optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(reference, _train(fresh, fresh_model, fresh_opt)))


def test_step_defaults_to_the_one_after_the_newest(tmp_path):
    strategy, model, _ = _adam()
    assert strategy.save(tmp_path, model=model).name == "step-00000000"
    assert strategy.save(tmp_path, model=model).name == "step-00000001"
    strategy.save(tmp_path, step=7, model=model)
    assert strategy.save(tmp_path, model=model).name == "step-00000008"
    assert strategy.restore(tmp_path, model=model)["step"] == 8


def test_a_step_saved_again_keeps_its_checkpoint_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    strategy, model, _ = _adam()
    strategy.save(tmp_path, step=1, model=model, note="first")
    rename = os.rename

    def killed_before_the_new_one_is_named(src, dst):
        if os.path.basename(src).startswith(".tmp-step-"):
            raise KeyboardInterrupt("killed")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_before_the_new_one_is_named)
    with pytest.raises(KeyboardInterrupt):
        strategy.save(tmp_path, step=1, model=model, note="second")
    monkeypatch.setattr(os, "rename", rename)
    assert [layout.step_of(p) for p in committed(tmp_path)] == [1]
    assert strategy.restore(tmp_path, model=model)["note"] == "first"

    strategy.save(tmp_path, step=1, model=model, note="third")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]
    assert strategy.restore(tmp_path, model=model)["note"] == "third"


@pytest.mark.parametrize("durable", [True, False])
def test_json_files_are_fsynced_when_durable(tmp_path, monkeypatch, durable):
    strategy, model, _ = _adam()
    synced = []
    fsync = os.fsync

    def recording(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    strategy.save(tmp_path, step=1, durable=durable, model=model)
    assert ({"loom.json", "rank-00000.json"} <= set(synced)) == durable


def test_a_checkpoint_of_another_format_is_refused_in_one_line(tmp_path):
    strategy, model, _ = _adam()
    strategy.save(tmp_path, step=1, model=model)
    strategy.save(tmp_path, step=2, model=model)
    meta = tmp_path / "step-00000002" / "loom.json"
    text = meta.read_text()
    meta.write_text(text.replace('"format": 1', '"format": 2'))
    recommit(tmp_path / "step-00000002")  # as a loom of format 2 would have committed it
    assert json.loads(meta.read_text())["format"] == 2
    for fallback in (False, True):  # not damage: an older checkpoint is not a substitute
        with pytest.raises(CheckpointMismatchError, match=r"step-00000002: saved in checkpoint format 2, and this loom reads format 1: restore it with the loom version that saved it"):
            strategy.restore(tmp_path, model=model, fallback=fallback)


class _Classifier(nn.Module):
    def __init__(self, head: str, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        setattr(self, head, nn.Linear(16, classes))
        self.head_name = head

    def forward(self, x):
        return getattr(self, self.head_name)(self.body(x))


def test_strict_false_loads_a_pretrained_body_into_a_model_with_a_new_head(tmp_path):
    torch.manual_seed(0)
    strategy = loom.OneDeviceStrategy()
    pretrained = _Classifier("head", 10)
    strategy.save(tmp_path, step=3, model=pretrained)

    torch.manual_seed(1)
    model = _Classifier("classifier", 2)
    new_head = model.classifier.weight.detach().clone()
    with pytest.raises(CheckpointMismatchError, match=r"has no tensor 'model.classifier.weight' \(here \[2, 16\]\).*strict=False"):
        strategy.restore(tmp_path, model=model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = strategy.restore(tmp_path, strict=False, model=model)
    assert torch.equal(model.body[0].weight, pretrained.body[0].weight)
    assert torch.equal(model.classifier.weight, new_head)
    assert saved["step"] == 3
    assert saved["missing_keys"] == ["model.classifier.weight", "model.classifier.bias"]
    assert saved["unexpected_keys"] == ["model.head.weight", "model.head.bias"]
    assert [str(w.message) for w in caught] == [
        f"loom: restored part of {tmp_path / 'step-00000003'}: 2 tensor(s) not in the checkpoint kept their values "
        "(model.classifier.weight, model.classifier.bias), 2 of its tensor(s) were not used (model.head.weight, model.head.bias)"
    ]


def _fit(directory, epochs, strategy, callbacks=()):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    return loom.fit(model, F.cross_entropy, lambda p: torch.optim.Adam(p, lr=0.01), data(80, 0), epochs=epochs, batch_size=20,
                    strategy=strategy, checkpoint_dir=str(directory), checkpoint_every=2, progress=False, callbacks=callbacks)  # fmt: skip


def test_fit_saves_each_step_once_and_the_epoch_end_with_its_logs(tmp_path):
    strategy = loom.OneDeviceStrategy()
    steps = []
    save = strategy.save
    strategy.save = lambda directory, **kw: steps.append(kw["step"]) or save(directory, **kw)
    _fit(tmp_path, 2, strategy)  # 4 steps an epoch, a save every 2
    assert steps == [2, 4, 6, 8]
    meta = json.loads((tmp_path / "step-00000004" / "loom.json").read_text())
    assert meta["plain"]["epoch"] == 1 and len(meta["plain"]["history"]["loss"]) == 1


def test_fit_arms_sigterm_only_while_it_trains(tmp_path):
    """SIGTERM stayed a save request for the rest of the process: a later SIGTERM only printed a line."""
    before = signal.getsignal(signal.SIGTERM)
    _fit(tmp_path, 1, loom.OneDeviceStrategy())
    assert signal.getsignal(signal.SIGTERM) is before and not preemption.armed()


def test_a_sigterm_after_fits_last_step_exits_0_at_fits_end(tmp_path):
    """It was heard and never acted on: the script went on after fit as if no SIGTERM had come."""
    script = tmp_path / "late.py"
    script.write_text(
        "import os, signal, sys\nimport loom\nfrom tests.checkpoint.test_durability import _fit\n"
        "class Late(loom.train.Callback):\n"
        "    def on_train_end(self, state):\n        os.kill(os.getpid(), signal.SIGTERM)\n"
        "_fit(sys.argv[1], 1, loom.OneDeviceStrategy(), callbacks=[Late()])\nprint('after fit', flush=True)\n"
    )
    done = run([sys.executable, str(script), str(tmp_path / "ckpt")], timeout=120, env=job_env())
    assert done.returncode == 0 and "after fit" not in done.stdout, done.stdout + done.stderr
    assert f"loom: preempted at the end of training; its last checkpoint is in {tmp_path / 'ckpt'}; exiting" in done.stdout
    assert layout.step_of(committed(tmp_path / "ckpt")[-1]) == 4  # the epoch's save


def test_fit_resumes_from_the_previous_checkpoint_when_the_newest_is_damaged(tmp_path, capsys):
    _fit(tmp_path, 2, loom.OneDeviceStrategy())
    data_file = next((tmp_path / "step-00000008").glob("*.distcp"))
    data_file.write_bytes(data_file.read_bytes()[:10])
    with pytest.warns(UserWarning, match=r"skipping a damaged checkpoint: .*step-00000008/__0_0\.distcp: truncated or altered"):
        history = _fit(tmp_path, 3, loom.OneDeviceStrategy())
    assert f"loom: resumed from {tmp_path / 'step-00000006'} (step 6, epoch 2)" in capsys.readouterr().out
    assert len(history["loss"]) == 3
    assert layout.step_of(committed(tmp_path)[-1]) == 12
