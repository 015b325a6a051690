"""Every replica calls save: ranks agree on a step nobody gave, and one that skips save is named
within seconds (not after the 300 s collective timeout, in gloo's words)."""

import os
import time

from torch import nn

import loom
from loom.errors import CheckpointError
from tests.helpers import run_ranks


def _try_save(strategy, directory, model, wait):
    os.environ["LOOM_SAVE_TIMEOUT"] = str(wait)
    start = time.monotonic()
    try:
        strategy.save(directory, model=model)
    except CheckpointError as error:
        return str(error), time.monotonic() - start
    return None, time.monotonic() - start


def _save_on_rank_0_only(directory):
    strategy = loom.MirroredStrategy(timeout=60)
    model = strategy.prepare(nn.Linear(2, 2))
    strategy.save(directory, async_save=True, model=model)  # no step: the ranks agree on one
    agreed = strategy.save(directory, model=model).name  # after an async save rank 0 may still be committing
    skipped = finished = (None, 0.0)
    if strategy.replica_id == 0:
        skipped = _try_save(strategy, directory, model, wait=2)
    strategy.barrier()  # rank 1 waits here meanwhile, alive: the next collective of `if rank == 0: save()`
    if strategy.replica_id == 0:
        finished = _try_save(strategy, directory, model, wait=60)  # rank 1 has returned and left the job
    strategy.shutdown()
    return agreed, skipped, finished


def test_a_save_on_one_rank_only_is_named_within_seconds(tmp_path):
    (agreed0, skipped, finished), (agreed1, *_) = run_ranks(_save_on_rank_0_only, 2, str(tmp_path), timeout=60)
    assert agreed0 == agreed1 == "step-00000001"
    line = open(__file__).read().split("\n").index("        strategy.save(directory, model=model)") + 1
    message, seconds = skipped
    assert message.startswith(f"strategy.save() was called at {__file__}:{line} on rank(s) 0, but rank(s) 1 did not call it within 2s (LOOM_SAVE_TIMEOUT sets how long to wait): every replica must call save() at the same point")
    assert "(no `if rank == 0:` around it)" in message and "\n" not in message
    assert seconds < 8, f"named after {seconds:.1f}s"  # 2 s of waiting, 2.5 s of heartbeats
    message, seconds = finished
    assert "but rank(s) 1 finished without calling it: every replica must call save()" in message
    assert seconds < 10, f"named after {seconds:.1f}s, not as soon as rank 1 left"
