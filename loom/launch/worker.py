"""Every loom worker starts here: ``python -m loom.launch.worker SCRIPT|-m MODULE [args]``.

(``--zygote FD PID`` starts the process that forks them instead, ``loom.launch.zygote``.)

It runs the user's program as ``__main__`` and ends the process through ``clean_exit``. Kept
out of the package's imports, so that ``-m`` does not find it imported already (the zygote
imports it as a module, to run ``main`` in the workers it forks).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from typing import Any, Callable, NoReturn

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from loom.launch.clean_exit import run_and_exit

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # set by torchrun's agent for each worker
ZYGOTE_FLAG = "--zygote"


def hand_exceptions_to_agent(print_it: Callable[..., Any]) -> Callable[..., Any]:
    """An excepthook that writes the exception to torchrun's error file instead of printing it.

    The launcher reads every rank's file and prints each distinct traceback once
    (``loom.launch.failures``): four ranks failing alike print one, not four. Outside an
    agent, or when the file cannot be written, the exception is printed as usual.
    """

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if os.environ.get(ERROR_FILE_ENV) and sys.exc_info()[1] is exc:  # record_exception formats the one being handled
            # The agent's SIGTERM must not cut the file short: a partial file fails the agent's read.
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                ErrorHandler().record_exception(exc)
                return
            except OSError:
                pass
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        print_it(exc_type, exc, tb)

    return hook


def main(argv: list[str]) -> NoReturn:
    if argv[:1] == [ZYGOTE_FLAG]:  # the launcher's zygote, which forks the workers (loom.launch.zygote)
        from loom.launch.zygote import serve

        serve(int(argv[1]), int(argv[2]))
        os._exit(0)
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit("usage: python -m loom.launch.worker SCRIPT [args] | -m MODULE [args]")
    sys.excepthook = hand_exceptions_to_agent(sys.excepthook)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        run_and_exit(lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    run_and_exit(lambda: runpy.run_path(argv[0], run_name="__main__"))


if __name__ == "__main__":
    main(sys.argv[1:])
