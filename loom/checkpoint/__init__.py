"""Checkpoints that any strategy and world size can restore, committed atomically, loaded safely."""

from loom.checkpoint.checkpointer import Checkpointer
from loom.checkpoint.layout import committed, resolve

__all__ = ["Checkpointer", "committed", "resolve"]
