"""Process workers' batches taken in by a thread of the training process while the loop trains.

Taking a finished batch from a ``DataLoader`` costs the training process about a millisecond:
unpickling the result, sending the next task, planning that task's addresses. Done by the loop
when it asks for the batch, that millisecond adds to every step (8% of a 14 ms step balanced
with the input); done here, it overlaps the step, as the DataLoader's pinning thread does for
CUDA batches. torchdata's ``Prefetcher`` does the same for a node, but it may leave its thread
inside the iterator when asked to stop, and a DataLoader iterator reset beside a thread still
reading it is a race: this receiver is stopped only once its thread is out.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")
_END = object()  # the results ran out
POLL_SECONDS = 0.1  # how soon a full receiver notices it is stopped or dropped


class Receiver(Generic[T]):
    """``results`` read up to ``depth`` ahead by a daemon thread; an error the reading raised is
    raised by ``next`` in its turn. Dropping the receiver (or ``stop``) ends the thread, so the
    iterator it read, and the workers behind it, can be collected. ``stop``: the event that
    stops it, shared with ``results`` when they wait on their own (a batch that never comes)."""

    def __init__(self, results: Iterator[T], depth: int, stop: threading.Event | None = None) -> None:
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = stop or threading.Event()
        self._ended = False
        self._pid = os.getpid()
        self._thread = threading.Thread(
            target=_receive, args=(results, self._queue, self._stop), name="loom-data-receiver", daemon=True
        )
        self._thread.start()

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if os.getpid() != self._pid:
            raise RuntimeError(
                "a loom.data loader with process workers cannot be iterated in a process forked from the one "
                "that started it (its batches are received by a thread there): make a new loader in this process"
            )
        if self._ended:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._ended = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        return item

    def stop(self) -> None:
        """Stop reading, without waiting: the thread leaves ``results`` at their next item."""
        self._stop.set()

    def close(self) -> None:
        """Stop reading and wait until the thread is out of ``results``: before the iterator behind
        them is reset (``results`` must end soon once stopped, as ``_in_sequence`` does)."""
        self._stop.set()
        self._thread.join()

    def __del__(self) -> None:  # the thread holds no reference to its receiver, so this runs
        self._stop.set()


def _receive(results: Iterator[T], out: queue.Queue, stop: threading.Event) -> None:
    for item in _guarded(results):
        if not _put(out, item, stop) or isinstance(item, BaseException):
            return  # stopped, or the error is the last item
    _put(out, _END, stop)


def _guarded(results: Iterator[T]) -> Iterator[T | BaseException]:
    """``results``, then the error that ended them, if any, as the last item (raised again in the
    loop's thread). No frame that holds the queue is in its traceback, and this one no longer holds
    it: else error, traceback and frames would make a cycle that keeps the DataLoader iterator in
    ``results`` (and its worker processes) alive after the receiver is dropped, until the cyclic
    collector happens to run."""
    try:
        yield from results
        return
    except GeneratorExit:  # the receiver stopped: closed here, the results are closed too
        raise
    except BaseException as error:  # noqa: BLE001 - raised again in the loop's thread
        raised = [error.with_traceback(error.__traceback__.tb_next)]  # type: ignore[union-attr] - set while handled
    yield raised.pop()


def _put(out: queue.Queue, item: object, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            out.put(item, timeout=POLL_SECONDS)
            return True
        except queue.Full:
            continue
    return False
