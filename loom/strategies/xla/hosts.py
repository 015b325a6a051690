"""How the hosts of an XLA job meet outside the compiled step: ``reduce``, ``gather`` and ``barrier``.

Each host's process drives all of its devices, so a host is one replica of the loop; the
values travel by JAX's multi-host utilities (one host: nothing to send).
"""

from __future__ import annotations

from typing import Any

import torch

COMBINE = {"sum": "sum", "mean": "mean", "max": "max", "min": "min", "product": "prod"}  # NumPy's names


class Hosts:
    """A ``loom.strategies.cross_replica.Transport`` over the job's hosts."""

    def __init__(self, jax: Any) -> None:
        self._jax = jax

    @property
    def count(self) -> int:
        return self._jax.process_count()

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.count == 1:
            return tensor
        import numpy as np
        from jax.experimental import multihost_utils

        every = np.asarray(multihost_utils.process_allgather(tensor.cpu().double().numpy()))
        return torch.as_tensor(getattr(np, COMBINE[op])(every, axis=0)).to(tensor.dtype)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Equal sizes across hosts (JAX gathers equal shapes)."""
        if self.count == 1:
            return tensor.clone()
        from jax.experimental import multihost_utils

        return torch.as_tensor(multihost_utils.process_allgather(tensor.detach().cpu().numpy(), tiled=True))

    def barrier(self) -> None:
        if self.count > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("loom barrier")
