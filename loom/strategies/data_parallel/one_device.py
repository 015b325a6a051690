"""One replica on one device: the default, and the reference every other strategy must match."""

from __future__ import annotations

import torch

from loom.strategies.base import Strategy


class OneDeviceStrategy(Strategy):
    """Runs on ``device`` (default: the first GPU, else the CPU) with no communication."""

    def __init__(self, device: str | torch.device | None = None, precision: str = "32", timeout: float | None = None):
        super().__init__(precision=precision, timeout=timeout)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = torch.device(device)

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @property
    def replica_id(self) -> int:
        return 0

    @property
    def device(self) -> torch.device:
        return self._device
