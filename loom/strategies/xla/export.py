"""The compiled, sharded training step as a StableHLO artifact, lowered for TPU on a machine without one.

``export_step(step, x, y, out)`` lowers the step's program with ``jax.export`` for the given
platforms and writes, under ``out``:

- ``train_step.mlir``: the StableHLO module, with the mesh and every argument's sharding;
- ``train_step.jax``: the serialized ``jax.export.Exported`` (``jax.export.deserialize`` loads it);
- ``manifest.json``: platforms, mesh, and the batch's shapes.

``loom xla export train.py --platform tpu OUT`` runs a training script up to its first
``train_step`` call, exports that step instead of running it, and stops the script.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

OUT_VARIABLE = "LOOM_XLA_EXPORT"  # set by the command: the first step exports itself here and exits
PLATFORMS_VARIABLE = "LOOM_XLA_EXPORT_PLATFORMS"
DEFAULT_PLATFORMS = ("tpu", "cpu")


def export_step(step: Any, inputs: Any, targets: Any, out: str | Path, platforms: tuple[str, ...] | list[str] = DEFAULT_PLATFORMS) -> Path:
    """Lower ``step`` (from ``TPUStrategy.train_step``) for a batch like ``inputs``/``targets``; nothing is trained."""
    import jax

    program, args = step.program(inputs, targets)
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) if isinstance(a, jax.Array) else a, args)
    exported = jax.export.export(program, platforms=list(platforms))(*specs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_step.mlir").write_text(exported.mlir_module())
    (out / "train_step.jax").write_bytes(exported.serialize())
    mesh = step.strategy.mesh
    batch = jax.tree.map(lambda a: {"shape": list(a.shape), "dtype": str(a.dtype)}, (args[6], args[7]))
    manifest = {"platforms": list(exported.platforms), "mesh": dict(mesh.shape), "devices": mesh.size, "batch": batch}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def export_requested() -> tuple[Path, tuple[str, ...]] | None:
    """Where ``loom xla export`` asked the running script's first step to be written, if it did."""
    out = os.environ.get(OUT_VARIABLE)
    if not out:
        return None
    return Path(out), tuple(os.environ.get(PLATFORMS_VARIABLE, ",".join(DEFAULT_PLATFORMS)).split(","))


def add_commands(parser: argparse.ArgumentParser) -> None:
    """``loom xla export``'s arguments."""
    actions = parser.add_subparsers(dest="action", required=True)
    export = actions.add_parser("export", help="write a script's compiled, sharded training step as StableHLO")
    export.add_argument("script", help="a training script that uses TPUStrategy.train_step (or loom.fit)")
    export.add_argument("output", help="the directory to write train_step.mlir, train_step.jax and manifest.json to")
    export.add_argument("--platform", default=",".join(DEFAULT_PLATFORMS), help="platforms to lower for, comma-separated (default: tpu,cpu)")
    export.add_argument("--devices", type=int, help="on a machine without them, lay the step out for this many devices (XLA's virtual CPU devices)")
    export.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def command(args: argparse.Namespace) -> int:
    """Run the script until its first step has exported itself."""
    if args.devices:
        if "jax" in sys.modules:
            raise RuntimeError("--devices must be set before JAX is imported")
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}".strip()
    (Path(args.output) / "manifest.json").unlink(missing_ok=True)
    os.environ[OUT_VARIABLE] = str(Path(args.output).resolve())
    os.environ[PLATFORMS_VARIABLE] = args.platform
    sys.argv = [args.script, *args.script_args]
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
        if (Path(args.output) / "manifest.json").exists():
            return 0
    finally:
        os.environ.pop(OUT_VARIABLE, None)
    print(f"loom: error: {args.script} ended without calling a TPUStrategy train_step, so there was no step to export", file=sys.stderr)
    return 2
