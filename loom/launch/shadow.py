"""A folder named ``loom`` where a job starts would be imported by its workers instead of loom.

Workers start as ``python -m loom.launch.worker`` in the launch folder, so Python searches that
folder first: a ``loom`` package there (a copy), or a plain directory (a clone's root) while
loom is installed in editable mode, replaces the real package, and every worker fails at import
with an error that does not say why. The launcher checks before it starts them.
"""

from __future__ import annotations

import sys
from importlib.machinery import PathFinder
from pathlib import Path

import loom
from loom.errors import LaunchError

PACKAGE = Path(loom.__file__).resolve().parent if loom.__file__ else None


def shadowing_folder(folder: Path, path: list[str]) -> Path | None:
    """``folder/loom`` when a worker started in ``folder`` with ``path`` after it would import it as loom."""
    candidate = folder / "loom"
    if not candidate.is_dir() or candidate.resolve() == PACKAGE:
        return None
    spec = PathFinder.find_spec("loom", [str(folder), *path])
    if spec is not None and spec.origin is not None and Path(spec.origin).resolve().parent == PACKAGE:
        return None  # the real package comes first; a namespace folder only counts when nothing on the path beats it
    return candidate


def check_not_shadowed(folder: Path | None = None) -> None:
    """Refuse, in one line, to start workers that would import another ``loom``."""
    folder = Path.cwd() if folder is None else folder
    found = shadowing_folder(folder, [p for p in sys.path if p and Path(p).resolve() != folder.resolve()])
    if found is not None:
        raise LaunchError(
            f"{found} shadows the loom package: workers start in {folder} and would import it instead of {PACKAGE}; "
            "start the job from another folder, or rename that directory"
        )
