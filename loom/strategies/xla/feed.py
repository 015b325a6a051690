"""Global batches onto the mesh, the next one sent while the current step runs.

Each host reads its share of every global batch with loom's ordinary loader (one host: the
whole batch), and a background thread reads ahead and starts the copy of each batch to the
devices, split over the ``data`` axis. The loop gets the batch as host tensors, as under any
strategy; the step finds the device copy already made.

Uneven last batch: loom's policy, as if every device of the ``data`` axis were a replica.
Its m samples are split in slices of ``ceil(m / devices)``, the missing places filled by
repeating the batch's first samples; ``valid_count`` says the first m are real.
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Any, Callable, Iterator

import torch

from loom.strategies.step import batch_len
from loom.strategies.xla.state import to_numpy
from loom.strategies.xla.tree import leaves, map_tensors

_DEVICE_COPY = "_loom_xla_copy"  # the attribute a fed host tensor carries its device array in
_END = object()


def attached(tensor: torch.Tensor) -> Any:
    """The device copy a fed batch tensor carries, or None."""
    return getattr(tensor, _DEVICE_COPY, None)


def pad_to(batch: Any, devices: int) -> Any:
    """The batch, its rows repeated from the start until they split evenly over ``devices``."""
    rows = batch_len(batch)
    if rows % devices == 0:
        return batch
    index = torch.arange(math.ceil(rows / devices) * devices) % rows
    return map_tensors(lambda t: t[index], batch)


class DeviceLoader:
    """Wraps this host's ``DistributedLoader`` (or pipeline loader); same position, epochs, ``valid_count``."""

    def __init__(self, inner: Any, devices: int, put: Callable[[torch.Tensor], Any], depth: int = 2) -> None:
        self.inner = inner
        self.devices = devices  # this host's devices on the data axis
        self._put = put
        self.depth = depth
        self._read = self._handed = 0  # batches read from ``inner`` (by the thread), handed out (by the loop)
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:  # global_batch, steps_per_epoch, device, set_epoch, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self) -> int:
        return len(self.inner)

    def valid_count(self, batch: int) -> int:
        return self.inner.valid_count(batch)

    def state_dict(self) -> dict[str, Any]:
        """The inner position, less what was read ahead: resuming gives exactly the next batch."""
        with self._lock:
            state = dict(self.inner.state_dict())
            state["batch"] -= self._read - self._handed
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def _feed(self, batches: Iterator[Any], out: queue.Queue, stop: threading.Event) -> None:
        def offer(item: Any) -> bool:
            """Wait for room in the queue, unless the loop has stopped taking batches."""
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            while True:
                with self._lock:  # the position the loop sees moves with what was read
                    batch = next(batches, _END)
                    if batch is _END:
                        break
                    self._read += 1
                batch = pad_to(batch, self.devices)
                for t in leaves(batch):
                    if isinstance(t, torch.Tensor):
                        setattr(t, _DEVICE_COPY, self._put(t))
                if not offer(batch):
                    return
            offer(_END)
        except BaseException as error:  # noqa: BLE001 - re-raised in the training loop
            offer(error)

    def __iter__(self) -> Iterator[Any]:
        self._read = self._handed = 0
        out: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        worker = threading.Thread(target=self._feed, args=(iter(self.inner), out, stop), name="loom-xla-feed", daemon=True)
        worker.start()
        try:
            while True:
                item = out.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                self._handed += 1
                yield item
        finally:
            stop.set()
            worker.join()


def device_array(t: torch.Tensor, sharding: Any) -> Any:
    """``t`` (this host's rows of a global batch) as one global array split by ``sharding``."""
    import jax

    return jax.make_array_from_process_local_data(sharding, to_numpy(t))
