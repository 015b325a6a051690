"""Checkpoints that any strategy and world size can restore, committed atomically, loaded safely."""

from typing import Any

from loom.checkpoint.layout import committed, resolve

__all__ = ["Checkpointer", "committed", "resolve"]


def __getattr__(name: str) -> Any:
    """``Checkpointer`` on first use: it imports DCP (and DTensor), a second of CPU that launchers never need."""
    if name == "Checkpointer":
        from loom.checkpoint.checkpointer import Checkpointer

        return Checkpointer
    raise AttributeError(f"module 'loom.checkpoint' has no attribute {name!r}")
