"""A trained model for serving: a ``torch.export`` program (``.pt2``) that loads with torch alone,
and ONNX beside it where the ``onnx`` package is installed.

The program is traced in eval mode (dropout off, BatchNorm on its running statistics) with the
batch dimension left free where the model allows it, so a server can send any batch size.
Strategies whose model is whole in each process export it directly; a sharded or pipelined
model goes through its checkpoint (``loom checkpoint export --format pt2``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.export import Dim

from loom.errors import CheckpointError
from loom.strategies.base import unwrap

FORMATS = ("pt2", "onnx", "safetensors")

ONNX_MISSING = "ONNX export needs the onnx and onnxscript packages: pip install onnx onnxscript (or export .pt2 only)"


def onnx_available() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("onnx", "onnxscript"))


def export(model: nn.Module, example_input: Any, path: str | Path, onnx: bool | None = None) -> list[Path]:
    """Write ``model`` (as ``prepare`` returned it, or the module) to ``path`` as a ``.pt2`` ExportedProgram.

    ``example_input`` is one batch of inputs (a tensor, or a tuple of the forward's arguments).
    ``onnx=None`` also writes ``path`` with the ``.onnx`` suffix where onnx is installed;
    ``True`` requires it, ``False`` skips it. Returns the files written. Load the program
    with ``torch.export.load(path).module()``.
    """
    module = _whole(unwrap(model))
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    path = Path(path)
    if onnx and not onnx_available():
        raise RuntimeError(ONNX_MISSING)
    training = module.training
    module.eval()
    try:
        program = torch.export.export(module, args, dynamic_shapes=_free_batch(args))
    finally:
        module.train(training)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, path)
    written = [path]
    if onnx or (onnx is None and onnx_available()):
        written.append(_onnx(program, args, path.with_suffix(".onnx")))
    return written


def _whole(module: nn.Module) -> nn.Module:
    """Refuse a model that no process holds whole, pointing at its checkpoint."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # never loaded: no parameter can be one
    if dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in module.parameters()):
        raise ValueError(
            "this model is sharded over processes (DTensor parameters), so no process can export it whole: "
            "save it with strategy.save(DIR, model=model), then run loom checkpoint export DIR OUT.pt2 --format pt2 --model MODULE:FACTORY"
        )
    return module


def _free_batch(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Dimension 0 of every tensor argument free where the model allows it (``Dim.AUTO`` keeps it fixed otherwise)."""
    return tuple({0: Dim.AUTO} if isinstance(a, torch.Tensor) and a.dim() > 0 else None for a in args)


def _onnx(program: torch.export.ExportedProgram, args: tuple[Any, ...], out: Path) -> Path:
    torch.onnx.export(program, args, str(out), dynamo=True)
    return out


def export_checkpoint(directory: str | Path, out: str | Path, fmt: str | None = None, name: str | None = None,
                      factory: str | None = None, input_shape: str | None = None, input_dtype: str = "float32") -> list[Path]:  # fmt: skip
    """``loom checkpoint export``: the saved model's weights as safetensors, or as a program (pt2, onnx).

    A program needs the model's code: ``factory`` is ``MODULE:FUNCTION`` returning the module
    (built as in training), and ``input_shape`` one batch's shape (``"1,4"``), filled with zeros.
    ``fmt=None`` follows ``out``'s suffix. ``onnx`` writes the ``.pt2`` beside the ``.onnx``.
    """
    from loom.checkpoint.describe import model_weights  # torch's DCP loads DTensor: not at `import loom`

    out = Path(out)
    fmt = fmt or {".pt2": "pt2", ".onnx": "onnx"}.get(out.suffix, "safetensors")
    if fmt not in FORMATS:
        raise CheckpointError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    weights, step = model_weights(directory, name)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in weights.items()}, str(out), metadata={"step": str(step)})
        return [out]
    if factory is None or input_shape is None:
        raise CheckpointError(
            f"--format {fmt} traces the model's code: pass --model MODULE:FUNCTION (returns the module) and --input-shape N,... (one batch)"
        )
    if fmt == "onnx" and not onnx_available():
        raise CheckpointError(ONNX_MISSING)
    model = _build(factory)
    model.load_state_dict(weights, strict=True)
    example = torch.zeros([int(d) for d in input_shape.split(",")], dtype=getattr(torch, input_dtype))
    return export(model, example, out.with_suffix(".pt2"), onnx=fmt == "onnx")


def _build(factory: str) -> nn.Module:
    module_name, sep, function = factory.partition(":")
    if not sep or not module_name or not function:
        raise CheckpointError(f"--model {factory!r} is not MODULE:FUNCTION (for example mypkg.models:build)")
    sys.path.insert(0, "")  # the working directory, as python -m does
    try:
        built = getattr(importlib.import_module(module_name), function)()
    except (ImportError, AttributeError) as exc:
        raise CheckpointError(f"--model {factory}: {exc}") from None
    finally:
        sys.path.remove("")
    if not isinstance(built, nn.Module):
        raise CheckpointError(f"--model {factory} returned a {type(built).__name__}, not a torch.nn.Module")
    return built
