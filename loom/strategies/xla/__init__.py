"""TPUStrategy on torchax and JAX; nothing here imports either until a strategy is created."""

from loom.strategies.xla.strategy import TPUStrategy

__all__ = ["TPUStrategy"]
