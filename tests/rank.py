"""One rank of ``tests.helpers.run_ranks``: ``python -m loom.launch.worker -m tests.rank DIR RANK``.

It calls the pickled ``(fn, args)`` in ``DIR/call.pkl`` and leaves ``(ok, value or traceback)``
in ``DIR/RANK.result``, whole or not at all, before it exits.
"""

import pickle
import sys
import traceback
from pathlib import Path


def main(directory: Path, rank: int) -> None:
    try:
        fn, args = pickle.loads((directory / "call.pkl").read_bytes())
        outcome = pickle.dumps((True, fn(*args)))  # plain pickle: tensors by value
    except BaseException:
        outcome = pickle.dumps((False, traceback.format_exc()))
    partial = directory / f"{rank}.partial"
    partial.write_bytes(outcome)
    partial.rename(directory / f"{rank}.result")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
