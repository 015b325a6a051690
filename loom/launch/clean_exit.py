"""How a loom worker ends: on purpose, after its program, skipping the interpreter's C++ teardown.

Once DDP has been built, PyTorch keeps the gloo process group (and its threads) alive past
``destroy_process_group`` (the C++ reducer holds it), and destroying it during the
interpreter's C++ teardown sometimes aborts a finished worker with "terminate called without
an active exception". So a worker runs the atexit handlers (loom commits a pending
asynchronous checkpoint there, then leaves the process group), flushes every open file, and
leaves with ``os._exit``, skipping only that teardown. ``os._exit`` ends every thread at once:
whatever must finish has to finish in an atexit handler.
"""

from __future__ import annotations

import gc
import io
import os
import sys
from typing import Any, Callable, NoReturn

from loom.compat import run_exit_handlers


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
    run_exit_handlers()  # CPython's own teardown step, run here so os._exit loses nothing
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
