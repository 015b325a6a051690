"""A trained model exported for serving loads and runs in a fresh process with torch alone."""

import subprocess
import sys

import pytest
import torch

import loom
from loom.launch.cli import main as cli
from loom.train.export import onnx_available
from tests.scripts.export_model import build

SERVE = """
import sys, torch
program = torch.export.load(sys.argv[1])
x = torch.load(sys.argv[2])
torch.save(program.module()(x), sys.argv[3])
print(sorted(m for m in sys.modules if m.split(".")[0] == "loom"))
"""


SERVE_ONNX = """
import sys, numpy, onnxruntime
session = onnxruntime.InferenceSession(sys.argv[1])
x = numpy.load(sys.argv[2])
numpy.save(sys.argv[3], session.run(None, {session.get_inputs()[0].name: x})[0])
print(sorted(m for m in sys.modules if m.split(".")[0] in ("loom", "torch")))
"""


def _trained(strategy):
    model, opt = strategy.prepare(build(), lambda p: torch.optim.SGD(p, lr=0.1))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        strategy.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    return model


def _served(program, x, tmp_path):
    """The program's outputs on ``x``, computed by a python that cannot import loom."""
    torch.save(x, tmp_path / "x.pt")
    done = subprocess.run([sys.executable, "-I", "-c", SERVE, str(program), str(tmp_path / "x.pt"), str(tmp_path / "y.pt")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"  # loom was never imported
    return torch.load(tmp_path / "y.pt")


def _served_onnx(model, x, tmp_path):
    """The ONNX model's outputs on ``x``, computed by onnxruntime in a python that imports neither loom nor torch."""
    import numpy as np

    np.save(tmp_path / "x.npy", x.numpy())
    done = subprocess.run([sys.executable, "-I", "-c", SERVE_ONNX, str(model), str(tmp_path / "x.npy"), str(tmp_path / "y.npy")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"
    return torch.from_numpy(np.load(tmp_path / "y.npy"))


def test_export_of_a_prepared_model_serves_without_loom(tmp_path):
    model = _trained(loom.OneDeviceStrategy())
    written = loom.export(model, torch.zeros(2, 4), tmp_path / "model.pt2", onnx=False)
    assert written == [tmp_path / "model.pt2"]
    assert model.training  # put back as it was
    x = torch.randn(5, 4)  # another batch size than the example's
    module = loom.unwrap(model).eval()
    with torch.no_grad():
        expected = module(x)
    assert torch.allclose(_served(tmp_path / "model.pt2", x, tmp_path), expected, atol=1e-6)


def test_checkpoint_export_writes_each_format(tmp_path, capsys):
    strategy = loom.OneDeviceStrategy()
    model = _trained(strategy)
    strategy.save(tmp_path / "ckpt", model=model)
    model = loom.unwrap(model).eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
    model_flags = ["--model", "tests.scripts.export_model:build", "--input-shape", "2,4"]

    def export(*args: str) -> tuple[int, str]:
        """``loom checkpoint export`` in this process (the program is then served by a fresh one)."""
        try:
            code = cli(["checkpoint", "export", str(tmp_path / "ckpt"), *args])
        except SystemExit as exit:
            code = exit.code
        return code, capsys.readouterr().err

    code, err = export(str(tmp_path / "model.pt2"), *model_flags)
    assert code == 0, err
    assert torch.allclose(_served(tmp_path / "model.pt2", x, tmp_path), expected, atol=1e-6)

    assert export(str(tmp_path / "m.pt2")) == (2, "loom: error: --format pt2 traces the model's code: pass --model MODULE:FUNCTION (returns the module) and --input-shape N,... (one batch)\n")

    code, err = export(str(tmp_path / "model.onnx"), *model_flags)
    if onnx_available():  # as make test installs it
        assert code == 0, err
        assert torch.allclose(_served_onnx(tmp_path / "model.onnx", x, tmp_path), expected, atol=1e-5)
    else:
        assert (code, err) == (2, "loom: error: ONNX export needs the onnx and onnxscript packages: pip install onnx onnxscript (or export .pt2 only)\n")


def test_onnx_asked_for_without_onnx_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr("loom.train.export.onnx_available", lambda: False)
    with pytest.raises(RuntimeError, match="pip install onnx onnxscript"):
        loom.export(build(), torch.zeros(2, 4), tmp_path / "m.pt2", onnx=True)
