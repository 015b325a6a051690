"""loom.checkpoint: round trips, atomic commits, damage and mismatch, portability across strategies."""

import os
import pickle
import random
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import loom
import loom.data as ld
from loom import compat
from loom.checkpoint import committed
from loom.errors import CheckpointError, CheckpointMismatchError
from tests.checkpoint.tamper import recommit
from tests.helpers import ROOT, SCRIPTS, job_env, loom_run, run


def _trained(seed=0):
    torch.manual_seed(seed)
    strategy = loom.OneDeviceStrategy()
    model, opt = strategy.prepare(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2)), lambda p: torch.optim.Adam(p, lr=0.05))
    for _ in range(3):
        strategy.backward(model(torch.randn(4, 5)).square().mean())
        opt.step()
        opt.zero_grad()
    return strategy, model, opt


def test_round_trip_of_model_optimizer_input_position_rng_and_values(tmp_path):
    strategy, model, opt = _trained()
    loader = strategy.distribute(ld.from_tensors(torch.arange(50)).shuffle(seed=2).batch(5))
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(3)]
    strategy.save(tmp_path, step=3, model=model, optimizer=opt, loader=loader, epoch=0, history={"loss": [0.5, 0.25]})
    after_save = (torch.rand(3), np.random.rand(), random.random())
    rest = [b.tolist() for b in it]

    fresh, fresh_model, fresh_opt = _trained(seed=7)
    fresh_loader = fresh.distribute(ld.from_tensors(torch.arange(50)).shuffle(seed=2).batch(5))
    saved = fresh.restore(tmp_path, model=fresh_model, optimizer=fresh_opt, loader=fresh_loader)
    assert (saved["step"], saved["epoch"], saved["history"]) == (3, 0, {"loss": [0.5, 0.25]})
    assert (torch.rand(3), np.random.rand(), random.random())[1:] == after_save[1:]
    for a, b in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), fresh_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert [b.tolist() for b in fresh_loader] == rest and len(seen) + len(rest) == 10


def test_nothing_to_restore_returns_none(tmp_path):
    strategy, model, _ = _trained()
    assert strategy.restore(tmp_path / "none-yet", model=model) is None


def test_keeps_the_last_k_and_restores_the_newest(tmp_path):
    strategy, model, opt = _trained()
    for step in range(1, 6):
        strategy.save(tmp_path, step=step, keep=2, model=model, marker=step)
    assert [p.name for p in committed(tmp_path)] == ["step-00000004", "step-00000005"]
    assert strategy.restore(tmp_path, model=model)["marker"] == 5


def test_async_save_is_written_by_another_process_and_committed_by_the_next_wait(tmp_path):
    strategy, model, opt = _trained()
    strategy.save(tmp_path, step=1, async_save=True, model=model, optimizer=opt)
    expected = [p.detach().clone() for p in model.parameters()]
    strategy.backward(model(torch.randn(4, 5)).sum())
    opt.step()  # training goes on: the checkpoint keeps the values of step 1
    strategy.shutdown()  # waits for the write and the commit
    writer = compat.checkpoint_process()
    assert writer is not None and writer.is_alive() and writer.pid != os.getpid(), "not written by DCP's checkpoint process"
    strategy.save(tmp_path, step=2, async_save=True, model=model)  # the same process writes the next one
    strategy.shutdown()
    assert compat.checkpoint_process() is writer and [p.name for p in committed(tmp_path)] == ["step-00000001", "step-00000002"]
    fresh, fresh_model, _ = _trained(seed=3)
    fresh.restore(tmp_path / "step-00000001", model=fresh_model)
    assert all(torch.equal(a, b) for a, b in zip(expected, fresh_model.parameters()))
    compat.stop_checkpoint_process()
    assert not writer.is_alive() and compat.checkpoint_process() is None


def test_kill_during_an_async_save_leaves_the_previous_checkpoint_and_no_writer(tmp_path):
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "async_big_save.py"), str(tmp_path)], cwd=ROOT, env=job_env(), stdout=subprocess.PIPE, text=True)
    try:
        writer = int(proc.stdout.readline())
        deadline = time.monotonic() + 60
        while not any(tmp_path.glob(".tmp-step-00000002/*.distcp")):
            assert time.monotonic() < deadline and proc.poll() is None, "the async save never started writing"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert [p.name for p in committed(tmp_path)] == ["step-00000001"]
    saved = loom.OneDeviceStrategy().restore(tmp_path, model=nn.Linear(4, 2))
    assert (saved["step"], saved["note"]) == (1, "small")
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{writer}") and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.path.exists(f"/proc/{writer}"):
        os.kill(writer, signal.SIGKILL)
        pytest.fail("the checkpoint process outlived the killed trainer by 30 s")


def test_kill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "big_saves.py"), str(tmp_path)], cwd=ROOT, env=job_env())
    try:
        deadline = time.monotonic() + 60
        while not any(tmp_path.glob(".tmp-step-00000002/*.distcp")):
            assert time.monotonic() < deadline and proc.poll() is None, "the big save never started"
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert [p.name for p in committed(tmp_path)] == ["step-00000001"], "killed too late: the save had committed"
    saved = loom.OneDeviceStrategy().restore(tmp_path, model=nn.Linear(4, 2))
    assert (saved["step"], saved["note"]) == (1, "small")


def test_truncated_file_is_named_and_fallback_takes_the_previous(tmp_path):
    strategy, model, opt = _trained()
    strategy.save(tmp_path, step=1, model=model, optimizer=opt)
    strategy.save(tmp_path, step=2, model=model, optimizer=opt)
    data = tmp_path / "step-00000002" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"step-00000002/__0_0\.distcp: truncated or altered \(100 bytes"):
        strategy.restore(tmp_path, model=model, optimizer=opt)
    with pytest.warns(UserWarning, match="skipping a damaged checkpoint"):
        assert strategy.restore(tmp_path, model=model, optimizer=opt, fallback=True)["step"] == 1


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_loading_never_runs_pickled_code(tmp_path):
    strategy, model, _ = _trained()
    path = strategy.save(tmp_path, step=1, model=model)
    evil = pickle.dumps(_Exploit())
    (path / ".metadata").write_bytes(evil)
    recommit(path)  # the marker agrees: only the unpickler stands in the way
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable checkpoint index \(refusing to load posix\.system"):
        strategy.restore(tmp_path, model=model)


def test_mismatched_model_names_the_key_and_both_shapes(tmp_path):
    strategy, model, _ = _trained()
    strategy.save(tmp_path, step=1, model=model)
    wider = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(CheckpointMismatchError, match=r"'model\.0\.weight' is \[8, 5\] in .* and \[16, 5\] here"):
        strategy.restore(tmp_path, model=wider)
    deeper = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2))
    with pytest.raises(CheckpointMismatchError, match=r"has no tensor 'model\.3\.weight' \(here \[2, 2\]\)"):
        strategy.restore(tmp_path, model=deeper)


def test_a_name_the_checkpoint_lacks_is_a_mismatch_that_loads_nothing_even_with_fallback(tmp_path):
    """A renamed object is no damage: fallback must not pass over the checkpoints, nor load half of one."""
    strategy, model, opt = _trained()
    strategy.save(tmp_path, step=1, model=model)
    strategy.save(tmp_path, step=2, model=model, optimizer=opt)
    other, fresh_model, fresh_opt = _trained(seed=1)
    before = {k: v.clone() for k, v in fresh_model.state_dict().items()}
    scheduler = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1)
    for fallback in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(CheckpointMismatchError, match=r"step-00000002 holds no 'scheduler' \(it holds: model, optimizer\); pass the names it was saved with$"):
                other.restore(tmp_path, model=fresh_model, optimizer=fresh_opt, scheduler=scheduler, fallback=fallback)
        assert not [w for w in caught if "damaged" in str(w.message)]
        assert all(torch.equal(before[k], v) for k, v in fresh_model.state_dict().items())


def test_unsupported_values_are_refused_with_the_reason(tmp_path):
    strategy, model, _ = _trained()
    with pytest.raises(CheckpointError, match="cannot save extra: a object is neither a tensor nor a JSON value"):
        strategy.save(tmp_path, step=1, model=model, extra=object())


def test_a_file_inside_a_checkpoint_and_a_module_without_weights_are_refused_in_one_line(tmp_path):
    strategy, model, _ = _trained()
    path = strategy.save(tmp_path, step=3, model=model)
    for name in ("loom.json", "rank-00000.json"):  # a file of the checkpoint found no checkpoint, and restored nothing
        with pytest.raises(ValueError) as refused:
            strategy.restore(path / name, model=model)
        assert str(refused.value) == (
            f"restore() takes a directory, and {path / name} is a file: pass the checkpoint directory {path} (or the one holding it, for its newest)"
        )
    for verb, call in {"restore": lambda: strategy.restore(tmp_path, model=nn.ReLU()), "save": lambda: strategy.save(tmp_path, step=4, model=nn.ReLU())}.items():
        with pytest.raises(ValueError) as refused:  # it was torch's "Default process group has not been initialized"
            call()
        assert str(refused.value) == (
            f"{verb}(model=...) got a ReLU with no parameters or buffers: nothing to {verb}; "
            "pass the model that holds the weights (the module given to prepare(), or what it returned)"
        )
    assert committed(tmp_path) == [path]


def test_portability_matrix_mirrored_4_to_one_device_and_mirrored_3(tmp_path):
    """Saved under MirroredStrategy with 4 replicas, restored exactly on 3 (uneven resharding) and on one.

    Every strategy's save and restore against OneDevice is in tests/contract/.
    """
    directory, reference = str(tmp_path / "ckpt"), str(tmp_path / "reference.pt")
    script = str(SCRIPTS / "checkpoint_job.py")
    saved = loom_run(["run", "--nproc", "4", script, "save", directory, reference])
    assert saved.returncode == 0, saved.stderr[-2000:]
    for nproc in (3,):
        restored = loom_run(["run", "--nproc", str(nproc), script, "restore", directory, reference])
        assert restored.returncode == 0, restored.stderr[-2000:]
        assert restored.stdout.count("restored identical state") == nproc
    alone = run([sys.executable, script, "restore", directory, reference], env=job_env(), timeout=60)
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert "replica 0 of 1: restored identical state" in alone.stdout

    inspect = loom_run(["checkpoint", "inspect", directory])
    assert inspect.returncode == 0, inspect.stderr
    assert "step 5, saved by MirroredStrategy on 4 replica(s)" in inspect.stdout
    assert "model.0.weight" in inspect.stdout and "float32   [32, 6]" in inspect.stdout
    assert "epoch = 2" in inspect.stdout and "optimizer.state.0.weight.exp_avg" in inspect.stdout
    exported = loom_run(["checkpoint", "export", directory, str(tmp_path / "model.safetensors")])
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load_file

    weights, expected = load_file(tmp_path / "model.safetensors"), torch.load(reference)["model"]
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)


def test_inspect_of_a_directory_without_checkpoints_says_so(tmp_path):
    run = loom_run(["checkpoint", "inspect", str(tmp_path)])
    assert run.returncode == 2
    assert f"loom: error: {tmp_path}: no complete checkpoint here" in run.stderr


def test_a_parameter_server_checkpoint_restores_into_mirrored(tmp_path):
    """ParameterServerStrategy joins the matrix: the chief's checkpoint restores under Mirrored."""
    import torch.nn.functional as F

    from loom.strategies.parameter_server import ParameterServer, ParameterServerStrategy
    from tests.helpers import free_port
    from tests.scripts.clicks import Clicks

    servers = [ParameterServer("job") for _ in range(2)]
    strategy = ParameterServerStrategy([f"127.0.0.1:{s.serve(free_port())}" for s in servers], token="job")
    torch.manual_seed(0)
    model, opt = strategy.prepare(Clicks(), lambda p: torch.optim.Adagrad(p, lr=0.1))
    for _ in range(5):
        ids = torch.randint(0, 50, (16, 4))
        F.binary_cross_entropy_with_logits(model(ids), (ids % 3 == 0).any(1).float()).backward()
        opt.step()
        opt.zero_grad()
    strategy.save(tmp_path / "ckpt", step=5, model=model, optimizer=opt)
    reference = tmp_path / "reference.pt"
    torch.save(strategy._consolidated(model).state_dict(), reference)
    strategy.shutdown()
    for s in servers:
        s.stop()
    run = loom_run(["run", "--nproc", "2", str(SCRIPTS / "restore_clicks.py"), str(tmp_path / "ckpt"), str(reference)])
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("MirroredStrategy replica") == 2
