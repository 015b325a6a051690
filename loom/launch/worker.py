"""How every loom worker starts and ends: ``python -m loom.launch.worker SCRIPT|-m MODULE [args]``.

It runs the user's program as ``__main__`` and then exits on purpose. Once DDP has been built,
PyTorch keeps the gloo process group (and its threads) alive past ``destroy_process_group``
(the C++ reducer holds it), and destroying it during the interpreter's C++ teardown
sometimes aborts a finished worker with "terminate called without an active exception".
So the worker runs the atexit handlers (loom's leave the process group there), flushes every
open file, and leaves with ``os._exit``, skipping only that teardown.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import runpy
import sys
from typing import Any, Callable, NoReturn


def _flush_open_files() -> None:
    """Flush what normal interpreter teardown would have: files the program never closed."""
    for obj in gc.get_objects():
        if issubclass(type(obj), io.IOBase):  # type(): some proxies warn when asked for __class__
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:
                pass


def _exit(code: int) -> NoReturn:
    atexit._run_exitfuncs()  # CPython's own teardown step, run here so os._exit loses nothing
    _flush_open_files()
    os._exit(code)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def run_and_exit(program: Callable[[], Any]) -> NoReturn:
    """Run ``program``, then end the process with its status (0, ``SystemExit``'s code, or 1)."""
    try:
        program()
    except SystemExit as exc:
        _exit(_exit_code(exc))
    except BaseException:
        sys.excepthook(*sys.exc_info())  # loom's hook tells the other ranks, then prints
        _exit(1)
    _exit(0)


def main(argv: list[str]) -> NoReturn:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit("usage: python -m loom.launch.worker SCRIPT [args] | -m MODULE [args]")
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        run_and_exit(lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    run_and_exit(lambda: runpy.run_path(argv[0], run_name="__main__"))


if __name__ == "__main__":
    main(sys.argv[1:])
