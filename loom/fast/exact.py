"""The exact speed-ups, on for every CPU job unless ``prepare(fast_path=False)``: they change no number.

- ``reuse_memory``: glibc keeps freed memory for the next step (``loom.fast.allocator``), set
  before the process started by loom's launcher, or here by ``mallopt`` once;
- ``pool_before_relu``: a ReLU that a max-pool follows runs after it (``loom.fast.fast_path``);
- ``pool_nhwc``: a max-pool given a contiguous batch pools a channels_last copy of it with eager's
  channels_last kernel (``loom.fast.nhwc_max_pool``).

``apply`` applies them to a model about to be wrapped, and returns the one line that says what
was applied (or undone, for ``fast_path=False``); ``allocator_only`` is for strategies whose
processes each hold part of the model, which get the allocator alone.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from loom.fast import allocator, nhwc_max_pool
from loom.fast.fast_path import pool_before_relu

OFF = "prepare(fast_path=False) turns it off"


def apply(module: nn.Module, fast_path: bool | Sequence[str] | None) -> str | None:
    """Apply the exact speed-ups to ``module`` (or, for ``fast_path=False``, leave it and undo the
    allocator's); the line that says what was done, or None when nothing was."""
    if fast_path is False:
        return _released()
    applied = [_reuse_memory()]
    pairs = pool_before_relu(module, True)
    if pairs:
        applied.append(f"pool_before_relu (ReLUs after the max-pools they precede, in {pairs} nn.Sequential)")
    pools = nhwc_max_pool.use(module)
    if pools:
        applied.append(f"pool_nhwc ({pools} nn.MaxPool2d pool a contiguous batch by the channels_last kernel)")
    return f"loom: fast path, exact (changes no number; {OFF}): " + ", ".join(applied)


def allocator_only(fast_path: bool | Sequence[str] | None) -> str | None:
    """The allocator's part of ``apply``, for a model that is not transformed here."""
    if fast_path is False:
        return _released()
    return f"loom: fast path, exact (changes no number; {OFF}): {_reuse_memory()}"


def _reuse_memory() -> str:
    how = allocator.keep()
    return f"reuse_memory ({how})" if how else f"not reuse_memory ({allocator.why_not()})"


def _released() -> str | None:
    if not allocator.release():
        return None
    return (
        "loom: fast path off (fast_path=False): glibc's malloc hands freed memory back again "
        "(its thresholds fixed at 32 MiB for mmap and 64 MiB for trim, where they slide to)"
    )
