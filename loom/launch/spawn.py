"""``loom.launch(main)``: one call at the bottom of a script makes it a multi-process job."""

from __future__ import annotations

import sys
from typing import Any, Callable

from loom.cluster import TorchrunEnvironment
from loom.errors import LaunchError
from loom.launch.torchrun import LaunchOptions, run_job
from loom.launch.clean_exit import run_and_exit


def _this_program() -> list[str]:
    """How to start the running script again: ``[path, args...]`` or ``['-m', module, args...]``."""
    main_module = sys.modules["__main__"]
    spec = getattr(main_module, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        module = spec.name.removesuffix(".__main__")
        return ["-m", module, *sys.argv[1:]]
    path = getattr(main_module, "__file__", None)
    if path is None:
        raise LaunchError(
            "loom.launch() starts the running script once per process, but this is an interactive "
            "session; put the code in a script and run it, or use `loom run script.py`"
        )
    return [path, *sys.argv[1:]]


def launch(main: Callable[[], Any], nproc: int | None = None, **options: Any) -> None:
    """Run ``main`` once per replica.

    Outside a job it re-runs this script under torchrun's agent with ``nproc`` processes on
    this node (``options`` are those of ``loom run``: nnodes, node_rank, master, threads,
    timeout, max_restarts), returns when the job succeeded and exits with its status if not.
    Inside a worker (started by ``loom run``, torchrun or the call above) it runs ``main()``
    and then ends the process cleanly (see ``loom.launch.clean_exit``): code after ``launch()``
    runs only in the launching process.
    """
    if TorchrunEnvironment.detect():
        run_and_exit(main)
    unknown = set(options) - set(LaunchOptions.__dataclass_fields__)
    if unknown:
        raise TypeError(f"launch() got unknown option(s) {sorted(unknown)}; valid: {sorted(LaunchOptions.__dataclass_fields__)}")
    code = run_job(_this_program(), LaunchOptions(nproc=nproc, **options))
    if code:
        raise SystemExit(code)
