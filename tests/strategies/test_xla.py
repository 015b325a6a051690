"""TPUStrategy (torchax + JAX) on 8 virtual XLA CPU devices, each compared with OneDevice.

One subprocess (``tests/scripts/xla_job.py``) runs every check that needs JAX: importing JAX
and compiling are the expensive part, so the assertions below share its results.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from types import SimpleNamespace
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import loom
from loom.strategies.xla.mesh import build_mesh
from loom.strategies.xla.optim import group_rules
from tests.contract.cases import GLOBAL_BATCH, mlp, save_reference, sgd
from tests.helpers import ROOT, SCRIPTS, job_env, run

pytestmark = pytest.mark.xdist_group("xla")

TOLERANCE = 1e-5
DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


@pytest.fixture(scope="session")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    if importlib.util.find_spec("torchax") is None:
        pytest.skip("the xla extra is not installed: pip install 'loom[xla]'")
    directory = tmp_path_factory.mktemp("xla")
    reference = save_reference(directory / "reference")
    done = run([sys.executable, str(SCRIPTS / "xla_job.py"), str(directory)], timeout=600, env=job_env(DEVICES))
    assert done.returncode == 0, done.stderr[-3000:]
    results = torch.load(directory / "results.pt", weights_only=False)
    results["reference"] = reference
    return directory, results


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_found_by_name_and_replicas_are_the_data_devices(job):
    _, got = job
    assert got["jax_with_loom"] is False  # JAX is imported when a TPUStrategy is created, not by `import loom`
    assert got["names"] == ["TPUStrategy", "TPUStrategy"]
    # as in TF: 8 replicas (the data devices), fed by one process on one host, which drives replica 0 onwards
    assert got["replicas"] == (8, 8, 1, 0)


@pytest.mark.parametrize("case", ["mlp_sgd", "cnn_sgd", "cnn_adamw_steplr"])
def test_equals_one_device_on_the_global_batch(job, case):
    _, got = job
    xla, one = got[case]["xla"], got[case]["one"]
    assert difference(xla["weights"], one["weights"]) <= TOLERANCE  # BatchNorm's running statistics included
    assert xla["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert xla["norms"] == pytest.approx(one["norms"], rel=1e-5)
    assert xla["lr"] == pytest.approx(one["lr"])
    assert (xla["eval"] - one["eval"]).abs().max() <= TOLERANCE  # the module holds the trained weights


def test_the_cases_do_what_they_say(job):
    """Equality above is not "nothing moved": training, statistics, schedule and clipping all act."""
    _, got = job
    untrained = mlp().state_dict()
    assert difference(got["mlp_sgd"]["one"]["weights"], untrained) > 0.05
    cnn = got["cnn_sgd"]["one"]["weights"]
    assert cnn["1.running_mean"].abs().max() > 1e-4 and (cnn["1.running_var"] - 1).abs().max() > 0.01
    assert cnn["1.num_batches_tracked"] == 3
    assert got["cnn_adamw_steplr"]["one"]["lr"] == pytest.approx(0.01 * 0.5**3)


def test_the_compiled_step_holds_the_cross_device_reduction(job):
    _, got = job
    assert got["hlo_all_reduce"] and got["stablehlo_sharded"]


def test_a_model_axis_gives_the_parameters_of_pure_data_parallelism(job):
    _, got = job
    specs = got["model_axis_specs"]
    assert any("model" in spec for spec in specs.values()), specs  # the large weights really are split
    assert any("model" not in spec for spec in specs.values()), specs  # the small ones are not
    assert difference(got["model_axis"]["xla"]["weights"], got["model_axis"]["dp"]["weights"]) <= TOLERANCE


def test_bf16_mixed_runs_convolutions_in_bfloat16(job):
    """Linear layers against OneDevice: tests/contract's bf16_mixed case."""
    _, got = job
    assert got["bf16_conv_dtypes"] == ["torch.bfloat16"]


def test_uneven_last_batch_is_padded_as_eight_replicas_would(job):
    _, got = job
    assert got["valid_counts"] == [16, 16, 12]
    assert difference(got["uneven"]["xla"], got["uneven"]["one"]) <= TOLERANCE


def test_distribute_sends_batches_to_the_devices_ahead(job):
    _, got = job
    assert got["feed"] == {"spec": "P('data',)", "devices": 8, "position": 1}


def test_eager_backward_points_to_train_step(job):
    _, got = job
    assert got["backward_error"].startswith("TPUStrategy compiles forward, backward and the update into one XLA program")
    assert "train_step" in got["backward_error"] and "\n" not in got["backward_error"]


def test_parameters_read_after_steps_are_the_trained_ones(job):
    _, got = job
    assert difference(got["parameters_read"], got["mlp_sgd"]["one"]["weights"]) <= TOLERANCE


def test_a_model_computing_its_own_loss_trains_as_on_one_device(job):
    _, got = job
    assert difference(got["own_loss"]["xla"], got["own_loss"]["one"]) <= TOLERANCE


def test_an_output_object_keeps_its_class(job):
    _, got = job
    assert got["own_loss_object"] == ("Output", (GLOBAL_BATCH, 2))


def test_accumulate_is_refused_when_called(job):
    _, got = job
    assert got.get("accumulate_error", "").startswith("TPUStrategy compiles forward, backward and the update into one XLA program, so there is no eager loop for accumulate() to count: pass accumulate=k")
    assert "\n" not in got["accumulate_error"]


def test_the_fast_path_is_refused_in_one_line(job):
    _, got = job
    assert got.get("fast_path_error", "").startswith("TPUStrategy does not take prepare(fast_path=...): XLA compiles every step already")
    assert "\n" not in got["fast_path_error"]


def test_a_checkpoint_moves_to_one_device_and_back(job):
    directory, got = job
    one = loom.OneDeviceStrategy()
    model, opt = one.prepare(mlp(), sgd)
    one.restore(directory / "saved", model=model, optimizer=opt)
    assert difference(model.state_dict(), got["saved"]) == 0.0
    assert all(s["momentum_buffer"].abs().sum() > 0 for s in opt.state_dict()["state"].values())
    assert difference(got["restored"], got["reference"]) == 0.0
    assert got["restored_momentum"] and all(m.abs().sum() > 0 for m in got["restored_momentum"].values())
    assert difference(got["after_restore"], got["after_restore_one"]) <= TOLERANCE  # the devices took the restored state


def test_export_writes_a_tpu_lowering_with_its_shardings(job):
    directory, got = job
    for out in (directory / "export", directory / "cli_export"):
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["devices"] == 8 and manifest["mesh"] == {"data": 8, "model": 1}
        text = (out / "train_step.mlir").read_text()
        assert "sharding" in text and '"data"' in text
        assert (out / "train_step.jax").stat().st_size > 0
    assert json.loads((directory / "export" / "manifest.json").read_text())["platforms"] == ["tpu", "cpu"]
    assert json.loads((directory / "cli_export" / "manifest.json").read_text())["platforms"] == ["tpu"]
    assert got["cli_export"] == 0 and not (ROOT / "should-not-be-written.pt").exists()


def test_without_the_extra_one_line_says_what_to_install():
    blocker = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('jax', 'torchax'): raise ImportError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import loom\n"
        "try:\n"
        "    loom.get_strategy('tpu')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120, cwd=ROOT, env=job_env())
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith("TPUStrategy needs the xla extra, which is missing (jax not found): pip install 'loom[xla]'")
    assert "\n" not in line


@pytest.mark.parametrize(
    "optimizer, line",
    [
        (lambda p: torch.optim.RMSprop(p), "TPUStrategy runs the optimizer inside its compiled step and knows torch.optim.SGD, Adam and AdamW, not RMSprop"),
        (lambda p: torch.optim.Adam(p, amsgrad=True), "TPUStrategy cannot run Adam(amsgrad=True) in its compiled step; use amsgrad=False"),
    ],
)
def test_an_optimizer_the_step_cannot_run_exactly_is_refused_by_name(optimizer, line):
    with pytest.raises(ValueError) as error:
        group_rules(optimizer(mlp().parameters()))
    assert str(error.value).startswith(line) and "\n" not in str(error.value)


def test_group_rules_follow_each_group():
    net = mlp()
    opt = torch.optim.SGD([{"params": net[0].parameters(), "momentum": 0.9, "nesterov": True}, {"params": net[2].parameters()}], lr=0.1)
    first, second = group_rules(opt)
    assert (first.momentum, first.nesterov, second.momentum) == (True, True, False)
    assert group_rules(torch.optim.AdamW(net.parameters()))[0].decoupled and not group_rules(torch.optim.Adam(net.parameters()))[0].decoupled


@pytest.mark.parametrize(
    "mesh, line",
    [
        ({"data": 4, "model": 4}, "TPUStrategy(mesh={'data': 4, 'model': 4}) needs 16 devices but JAX sees 8 (cpu); make data x model equal 8"),
        ({"batch": 8}, "TPUStrategy(mesh=...) takes the axes 'data' and 'model', not batch"),
        ({"data": 0, "model": 8}, "TPUStrategy(mesh={'data': 0, 'model': 8}): every axis needs a positive number of devices"),
    ],
)
def test_a_mesh_that_does_not_fit_the_devices_is_refused_in_one_line(mesh, line):
    devices = SimpleNamespace(devices=lambda: [SimpleNamespace(platform="cpu")] * 8)
    with pytest.raises(ValueError) as error:
        build_mesh(devices, mesh, 1 << 16)
    assert str(error.value) == line
