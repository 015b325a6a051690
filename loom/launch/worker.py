"""Every loom worker starts here: ``python -m loom.launch.worker SCRIPT|-m MODULE [args]``.

It runs the user's program as ``__main__`` and ends the process through ``clean_exit``. Kept
out of the package's imports, so that ``-m`` runs it exactly once.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import NoReturn

from loom.launch.clean_exit import run_and_exit


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
