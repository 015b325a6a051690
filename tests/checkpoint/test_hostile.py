"""Checkpoints that were tampered with or damaged: nothing in them runs, nothing damaged loads, fallback passes them."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import loom
from loom.checkpoint import committed, layout
from loom.checkpoint.describe import describe, model_weights
from loom.errors import CheckpointError, CheckpointMismatchError
from loom.launch.cli import main as cli
from tests.checkpoint import tamper
from tests.helpers import loom_run
from tests.scripts.fit_job import data


def _trained(seed=0):
    torch.manual_seed(seed)
    strategy = loom.OneDeviceStrategy()
    model, opt = strategy.prepare(nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2)), lambda p: torch.optim.Adam(p, lr=0.05))
    for _ in range(2):
        strategy.backward(model(torch.randn(4, 5)).square().mean())
        opt.step()
        opt.zero_grad()
    return strategy, model, opt


def _values(model):
    return [p.detach().clone() for p in model.parameters()]


def _largest_tensor_file(path):
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def test_a_bytes_entry_in_the_index_runs_nothing_and_is_refused_naming_file_and_key(tmp_path, capsys):
    strategy, model, opt = _trained()
    path = strategy.save(tmp_path / "ckpt", step=1, model=model)
    marker = tmp_path / "payload-ran"
    tamper.bytes_entry(path, "model.0.weight", marker)
    refused = rf"{path}/\.metadata: 'model\.0\.weight' is a BytesStorageMetadata, not the TensorStorageMetadata loom writes for a tensor"
    with pytest.raises(CheckpointError, match=refused):
        strategy.restore(tmp_path / "ckpt", model=model)
    with pytest.raises(CheckpointError, match=refused):
        describe(path)  # loom checkpoint inspect
    with pytest.raises(CheckpointError, match=refused):
        model_weights(path)  # loom checkpoint export
    capsys.readouterr()  # what training said (the fast path's line)
    assert cli(["checkpoint", "verify", str(path)]) == 1
    assert capsys.readouterr().err.splitlines() == [f"{path}/.metadata: 'model.0.weight' is a BytesStorageMetadata, "
                                                    "not the TensorStorageMetadata loom writes for a tensor: refusing to read this checkpoint"]  # fmt: skip
    assert not marker.exists(), "the checkpoint's pickle ran"


def test_storage_outside_the_checkpoint_is_refused_naming_the_key(tmp_path):
    strategy, model, _ = _trained()
    path = strategy.save(tmp_path / "ckpt", step=1, model=model)
    shutil.copy(path / "__0_0.distcp", tmp_path / "outside.distcp")
    metadata = tamper.index(path)
    for where, info in metadata.storage_data.items():
        if where.fqn == "model.0.weight":
            info.relative_path = "../../outside.distcp"  # the same bytes, read from outside the checkpoint
    tamper.write_index(path, metadata)
    tamper.recommit(path)
    with pytest.raises(CheckpointError, match=r"\.metadata: the storage of 'model\.0\.weight' is '\.\./\.\./outside\.distcp', which is not a file of this checkpoint"):
        strategy.restore(tmp_path / "ckpt", model=model)


def test_an_index_entry_with_a_field_dcp_does_not_write_is_refused_naming_the_key(tmp_path):
    strategy, model, _ = _trained()
    path = strategy.save(tmp_path / "ckpt", step=1, model=model)
    metadata = tamper.index(path)
    vars(metadata.state_dict_metadata["model.2.bias"])["extra"] = "anything"
    tamper.write_index(path, metadata)
    tamper.recommit(path)
    with pytest.raises(CheckpointError, match=r"\.metadata: 'model\.2\.bias' is a TensorStorageMetadata with extra, which loom never writes"):
        strategy.restore(tmp_path / "ckpt", model=model)


def test_a_file_the_marker_does_not_list_is_never_read(tmp_path):
    strategy, model, _ = _trained()
    path = strategy.save(tmp_path, step=1, model=model)
    listing = json.loads((path / "COMMITTED").read_text())
    for part in ("files", "blocks"):
        del listing[part][".metadata"]
    (path / "COMMITTED").write_text(json.dumps(listing))
    with pytest.raises(CheckpointError, match=rf"^{path}/\.metadata: not listed in COMMITTED: this is not a complete checkpoint"):
        strategy.restore(tmp_path, model=model)


def test_the_commit_records_the_xxh3_128_of_each_16_mib_of_every_file(tmp_path):
    strategy, model, opt = _trained()
    path = strategy.save(tmp_path, step=1, model=model, optimizer=opt, big=torch.arange(2**23, dtype=torch.float32))  # 32 MiB
    listing = json.loads((path / "COMMITTED").read_text())
    files = sorted(p.name for p in path.iterdir() if p.name != "COMMITTED")
    assert listing["digest"] == "xxh3_128"
    assert sorted(listing["files"]) == sorted(listing["blocks"]) == files
    assert all(listing["blocks"][n] == tamper.block_digests(path / n) for n in files)
    assert max(len(d) for d in listing["blocks"].values()) == 3  # 32 MiB and the zip's few bytes more
    damaged = _largest_tensor_file(path)
    tamper.flip(damaged)  # in its second block
    with pytest.raises(CheckpointError, match=rf"^{damaged}: damaged: its content differs from the xxh3_128"):
        strategy.restore(tmp_path, model=model, optimizer=opt, big=torch.zeros(2**23))


@pytest.mark.parametrize("at", [0, 2**24 - 8, -16], ids=["first bytes", "across a block boundary", "last bytes"])
def test_a_damaged_block_is_refused_before_dcp_reads_a_byte_of_it(tmp_path, at):
    """Wherever the damage lies: the zip header DCP reads first, the end it seeks to first, or tensor bytes across two blocks.
    Had DCP read it, torch.load would fail on its own words or load the damaged values."""
    strategy, model, opt = _trained()
    big = torch.arange(2**23, dtype=torch.float32)  # 32 MiB: its file has three blocks
    path = strategy.save(tmp_path, step=1, model=model, optimizer=opt, big=big)
    saved = _values(model) + [big]
    damaged = _largest_tensor_file(path)
    tamper.flip(damaged, at=at)
    fresh, fresh_model, fresh_opt = _trained(seed=5)
    fresh_big = torch.zeros(2**23)
    before = _values(fresh_model) + [fresh_big.clone()]
    with pytest.raises(CheckpointError) as raised:
        fresh.restore(tmp_path, model=fresh_model, optimizer=fresh_opt, big=fresh_big)
    assert str(raised.value).startswith(f"{damaged}: damaged: its content differs from the xxh3_128 recorded when it was saved; ")
    for now, old, good in zip(_values(fresh_model) + [fresh_big], before, saved):
        assert torch.equal(now, old) or torch.equal(now, good)


def test_flipped_bytes_are_named_and_no_damaged_value_reaches_the_model(tmp_path):
    strategy, model, opt = _trained()
    path = strategy.save(tmp_path, step=1, model=model, optimizer=opt)
    saved = _values(model)
    damaged = _largest_tensor_file(path)
    tamper.flip(damaged)
    fresh, fresh_model, fresh_opt = _trained(seed=5)
    before = _values(fresh_model)
    with pytest.raises(CheckpointError, match=rf"^{damaged}: damaged: its content differs from the xxh3_128 recorded when it was saved; restore\(\.\.\., fallback=True\)"):
        fresh.restore(tmp_path, model=fresh_model, optimizer=fresh_opt)
    for now, old, good in zip(_values(fresh_model), before, saved):  # each as it was, or as saved: never damaged
        assert torch.equal(now, old) or torch.equal(now, good)


def test_fallback_passes_a_damaged_newest_checkpoint_and_says_which_and_why(tmp_path):
    strategy, model, opt = _trained()
    strategy.save(tmp_path, step=1, model=model, optimizer=opt)
    first = _values(model)
    strategy.backward(model(torch.randn(4, 5)).sum())
    opt.step()
    newest = strategy.save(tmp_path, step=2, model=model, optimizer=opt)
    damaged = _largest_tensor_file(newest)
    tamper.flip(damaged)
    fresh, fresh_model, fresh_opt = _trained(seed=5)
    with pytest.warns(UserWarning, match=rf"loom: skipping a damaged checkpoint: {damaged}: damaged: its content differs from the xxh3_128"):
        assert fresh.restore(tmp_path, model=fresh_model, optimizer=fresh_opt, fallback=True)["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(_values(fresh_model), first))


def test_a_tensor_that_does_not_load_is_one_line_naming_it_and_fallback_passes_it(tmp_path):
    """torch's error there is a BaseException holding every rank's traceback, and advises weights_only=False."""
    strategy, model, opt = _trained()
    strategy.save(tmp_path, step=1, model=model, optimizer=opt)
    newest = strategy.save(tmp_path, step=2, model=model, optimizer=opt)
    info = next(info for where, info in tamper.index(newest).storage_data.items() if where.fqn == "model.0.weight")
    data_file = newest / info.relative_path
    data = bytearray(data_file.read_bytes())
    data[info.offset : info.offset + 64] = bytes(64)
    data_file.write_bytes(bytes(data))
    tamper.recommit(newest)  # the marker agrees: only reading the tensor finds the damage
    with pytest.raises(CheckpointError) as raised:
        strategy.restore(tmp_path, model=model, optimizer=opt)
    assert str(raised.value).startswith(f"{data_file}: 'model.0.weight' (bytes {info.offset}-{info.offset + info.length}) is not a tensor "
                                        "that loads with weights_only=True (UnpicklingError)")  # fmt: skip
    assert "\n" not in str(raised.value)
    with pytest.warns(UserWarning, match=rf"skipping a damaged checkpoint: {data_file}: 'model\.0\.weight'"):
        assert strategy.restore(tmp_path, model=model, optimizer=opt, fallback=True)["step"] == 1


def _fit(directory, epochs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    return loom.fit(model, F.cross_entropy, lambda p: torch.optim.Adam(p, lr=0.01), data(80, 0), epochs=epochs, batch_size=20,
                    strategy=loom.OneDeviceStrategy(), checkpoint_dir=str(directory), checkpoint_every=2, progress=False)  # fmt: skip


def test_fit_resumes_past_a_newest_checkpoint_with_flipped_bytes(tmp_path, capsys):
    _fit(tmp_path, 2)
    damaged = _largest_tensor_file(tmp_path / "step-00000008")
    tamper.flip(damaged)
    with pytest.warns(UserWarning, match=rf"skipping a damaged checkpoint: {damaged}: damaged: its content differs"):
        _fit(tmp_path, 3)
    assert f"loom: resumed from {tmp_path / 'step-00000006'} (step 6, epoch 2)" in capsys.readouterr().out


def test_verify_names_each_damaged_checkpoint_and_exits_nonzero(tmp_path, capsys):
    strategy, model, opt = _trained()
    for step in (1, 2, 3):
        strategy.save(tmp_path, step=step, model=model, optimizer=opt)
    assert cli(["checkpoint", "verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[0] for line in out] == [str(p) for p in committed(tmp_path)]
    assert all(": intact (" in line and "xxh3_128 checked)" in line for line in out)

    flipped = _largest_tensor_file(tmp_path / "step-00000001")
    tamper.flip(flipped)
    truncated = tmp_path / "step-00000003" / "loom.json"
    truncated.write_text(truncated.read_text()[:-5])
    assert cli(["checkpoint", "verify", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"{flipped}: damaged: its content differs from the xxh3_128 recorded when it was saved",
        f"{truncated}: truncated or altered ({truncated.stat().st_size} bytes, {truncated.stat().st_size + 5} when saved)",
    ]
    assert captured.out.startswith(f"{tmp_path / 'step-00000002'}: intact (")
    assert cli(["checkpoint", "verify", str(tmp_path / "step-00000002")]) == 0


def test_a_checkpoint_saved_before_digests_still_restores_and_verify_says_so(tmp_path, capsys):
    strategy, model, opt = _trained()
    path = strategy.save(tmp_path, step=1, model=model, optimizer=opt)
    listing = json.loads((path / "COMMITTED").read_text())
    (path / "COMMITTED").write_text(json.dumps({"files": listing["files"]}))  # as loom wrote it before digests
    fresh, fresh_model, fresh_opt = _trained(seed=5)
    assert fresh.restore(tmp_path, model=fresh_model, optimizer=fresh_opt)["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(_values(fresh_model), _values(model)))
    assert cli(["checkpoint", "verify", str(tmp_path)]) == 0
    assert "sizes intact, contents unchecked: saved before loom recorded digests" in capsys.readouterr().out


def _recorded_as(path, algorithm):
    """Rewrite ``path``'s COMMITTED as loom records ``algorithm``: SHA-256 under its own key, as loom first wrote it."""
    sizes = json.loads((path / "COMMITTED").read_text())["files"]
    blocks = dict(zip(sizes, layout.digests(path, sizes, algorithm=algorithm)))
    listing = {"files": sizes, "sha256": blocks} if algorithm == "sha256" else {"files": sizes, "digest": algorithm, "blocks": blocks}
    (path / "COMMITTED").write_text(json.dumps(listing))


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
def test_a_checkpoint_is_checked_with_the_algorithm_it_records_and_damage_is_refused(tmp_path, capsys, algorithm):
    """SHA-256 checkpoints, saved before loom recorded the algorithm, still verify and restore."""
    strategy, model, opt = _trained()
    intact, damaged = (strategy.save(tmp_path / name, step=1, model=model, optimizer=opt) for name in ("intact", "damaged"))
    for path in (intact, damaged):
        _recorded_as(path, algorithm)
    fresh, fresh_model, fresh_opt = _trained(seed=5)
    assert fresh.restore(intact, model=fresh_model, optimizer=fresh_opt)["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(_values(fresh_model), _values(model)))
    assert cli(["checkpoint", "verify", str(intact)]) == 0
    assert f"{algorithm} checked)" in capsys.readouterr().out

    flipped = _largest_tensor_file(damaged)
    tamper.flip(flipped)
    with pytest.raises(CheckpointError, match=rf"^{flipped}: damaged: its content differs from the {algorithm} recorded when it was saved"):
        fresh.restore(damaged, model=fresh_model, optimizer=fresh_opt)
    assert cli(["checkpoint", "verify", str(damaged)]) == 1
    assert capsys.readouterr().err.splitlines() == [f"{flipped}: damaged: its content differs from the {algorithm} recorded when it was saved"]


def test_digests_of_an_unknown_algorithm_are_refused_in_one_line(tmp_path, capsys):
    strategy, model, _ = _trained()
    path = strategy.save(tmp_path, step=1, model=model)
    listing = json.loads((path / "COMMITTED").read_text())
    (path / "COMMITTED").write_text(json.dumps({**listing, "digest": "blake9"}))
    refused = (
        f"{path / 'COMMITTED'}: its digests use 'blake9', which this loom does not know (xxh3_128, sha256); "
        "verify or restore it with the loom that saved it"
    )
    with pytest.raises(CheckpointError) as raised:
        strategy.restore(tmp_path, model=model)
    assert str(raised.value).startswith(refused + "; ") and "\n" not in str(raised.value)
    assert cli(["checkpoint", "verify", str(path)]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == refused


def test_every_replica_refuses_a_damaged_checkpoint_in_the_same_line_and_falls_back_together(tmp_path):
    run = loom_run(["run", "--nproc", "2", str(Path(__file__).parent / "damaged_job.py"), str(tmp_path)])
    assert run.returncode == 0, run.stderr[-3000:]
    refused = re.findall(r"replica (\d): refused: (\S+): damaged: its content differs from the xxh3_128", run.stdout)  # lines may interleave
    assert sorted(r for r, _ in refused) == ["0", "1"] and refused[0][1] == refused[1][1], run.stdout
    assert re.fullmatch(rf"{tmp_path}/step-00000002/__\d_\d\.distcp", refused[0][1])
    fell_back = re.findall(r"replica (\d): fell back to step (\d+), weights (equal|differ)", run.stdout)
    assert sorted(fell_back) == [("0", "1", "equal"), ("1", "1", "equal")], run.stdout
    assert "skipping a damaged checkpoint" in run.stderr


def test_a_policy_that_asks_for_sha256_gets_it_and_a_name_loom_lacks_is_one_line(tmp_path, monkeypatch):
    strategy, model, opt = _trained()
    monkeypatch.setenv("LOOM_CHECKPOINT_DIGEST", "sha256")
    path = strategy.save(tmp_path / "sha", step=1, model=model, optimizer=opt)
    assert json.loads((path / "COMMITTED").read_text())["digest"] == "sha256"
    assert strategy.restore(path, model=model, optimizer=opt)["step"] == 1
    monkeypatch.setenv("LOOM_CHECKPOINT_DIGEST", "SHA256")  # any case
    assert json.loads((strategy.save(tmp_path / "upper", step=1, model=model) / "COMMITTED").read_text())["digest"] == "sha256"
    monkeypatch.setenv("LOOM_CHECKPOINT_DIGEST", "md5")
    with pytest.raises(CheckpointError, match=r"^LOOM_CHECKPOINT_DIGEST='md5' is not a digest loom knows: use one of xxh3_128, sha256$"):
        strategy.save(tmp_path / "md5", step=1, model=model, optimizer=opt)
    assert not (tmp_path / "md5").exists()  # refused before anything was written


def test_when_every_checkpoint_is_damaged_fallback_says_none_is_intact(tmp_path):
    strategy, model, opt = _trained()
    for step in (1, 2):
        tamper.flip(_largest_tensor_file(strategy.save(tmp_path, step=step, model=model, optimizer=opt)))
    oldest = _largest_tensor_file(tmp_path / "step-00000001")
    with pytest.warns(UserWarning, match="skipping a damaged checkpoint"), pytest.raises(CheckpointError) as raised:
        strategy.restore(tmp_path, model=model, optimizer=opt, fallback=True)
    assert str(raised.value).startswith(f"{oldest}: damaged: ")
    assert str(raised.value).endswith("; none of the 2 checkpoint(s) tried is intact")


def test_an_optimizer_of_another_model_is_a_usage_error_not_damage(tmp_path):
    strategy, model, opt = _trained()
    strategy.save(tmp_path, step=1, model=model, optimizer=opt)
    other = nn.Linear(5, 2)
    with pytest.raises(CheckpointMismatchError) as raised:
        strategy.restore(tmp_path, model=model, optimizer=torch.optim.Adam(other.parameters()), fallback=True)
    assert str(raised.value) == "an optimizer is saved and restored with its model: pass both, e.g. save(dir, model=model, optimizer=opt)"


def test_an_fp16_checkpoint_restored_in_fp32_returns_no_scaler_entries(tmp_path):
    torch.manual_seed(0)
    half = loom.OneDeviceStrategy(precision="16-mixed")
    model, opt = half.prepare(nn.Linear(5, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    half.backward(model(torch.randn(4, 5)).square().mean())
    opt.step()
    half.save(tmp_path, step=1, model=model, optimizer=opt, epoch=3)
    full = loom.OneDeviceStrategy()
    model, opt = full.prepare(nn.Linear(5, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    restored = full.restore(tmp_path, model=model, optimizer=opt)
    assert {k for k in restored if k not in ("path", "strategy", "world_size")} == {"epoch", "step"}


def test_verify_of_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    assert cli(["checkpoint", "verify", str(tmp_path / "nowhere")]) != 0
    assert capsys.readouterr().err.strip().endswith(f"{tmp_path / 'nowhere'}: no such file or directory")
