"""Process workers: a ``DataLoader`` whose "indices" are batches of addresses, for its persistent
workers and shared-memory transfer, kept in order and a bounded distance ahead of the loop.

``Claims`` hands out each batch's addresses with the shared buffer its batch is written into;
``Window`` bounds how far tasks run ahead (idle tasks fill the DataLoader's requests meanwhile);
``in_sequence`` puts results back in the order their tasks were sent and names a dead worker.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Iterable, Iterator

import torch
from torch.utils.data import Dataset, Sampler

from loom import compat
from loom.data.batch_worker import BatchResult, BatchWorker
from loom.data.plan import Chunk
from loom.data.shared_batches import BatchBuffers

RECEIVED_AHEAD = 2  # process workers' batches taken in ahead of the loop (receiver.py)
# Shared buffers beyond the tasks in flight: the batches received ahead and the one the receiver
# holds, the batch the loop holds, the one before, a spare.
HELD_BATCHES = RECEIVED_AHEAD + 1 + 3
IDLE_SECONDS = 0.002  # a process worker's idle task, while the loop waits for a slower worker's batch
DEAD_WORKER_CHECK_SECONDS = 1.0  # how often workers are looked at while only idle tasks come back


class Window:
    """How far tasks run ahead: ``size`` past the oldest unfinished one, so workers ahead of a
    slow batch do not read on without bound, and ``ahead`` past the batch the receiver is to take
    next (the shared buffers' count, less ``HELD_BATCHES``). Workers mark what they finish in
    shared memory: the DataLoader sends its next task as a result arrives, before the receiver
    sees it, and a window counted from the batches handed out alone would then still be full,
    its free slots idle tasks at a pass's end."""

    def __init__(self, size: int, ahead: int, workers: int) -> None:
        self.size = size
        self.ahead = ahead
        self.finished = torch.full((size,), -1, dtype=torch.int64).share_memory_()  # slot s % size: s, once done
        self.idle_done = torch.zeros(max(workers, 1), dtype=torch.int64).share_memory_()  # per worker
        self.sent = 0
        self.oldest = 0  # the oldest task not known to be finished
        self.handed = 0  # results handed on (to the receiver, at most RECEIVED_AHEAD + 1 ahead of the loop)
        self.idle_taken = 0

    def reset(self) -> None:
        """A new iteration: the workers have finished or discarded the earlier one's tasks."""
        self.finished.fill_(-1)
        self.idle_done.zero_()
        self.sent = self.oldest = self.handed = self.idle_taken = 0

    def full(self) -> bool:
        while self.oldest < self.sent and int(self.finished[self.oldest % self.size]) == self.oldest:
            self.oldest += 1
        return self.sent - self.oldest >= self.size or self.sent - self.handed >= self.ahead

    def finish(self, sequence: int) -> None:
        """In a worker: task ``sequence`` is done (-1: an idle task)."""
        if sequence >= 0:
            self.finished[sequence % self.size] = sequence
        else:
            info = torch.utils.data.get_worker_info()
            self.idle_done[info.id if info is not None else 0] += 1

    def idle_waiting(self) -> bool:
        """Whether an idle task's result is ready to be taken (taking it sends a task)."""
        return int(self.idle_done.sum()) > self.idle_taken


_IDLE = (None, None, -1)  # a task with nothing to do: the window is full


class Claims(Sampler[tuple[Chunk | None, int | None, int]]):
    """Each batch of addresses with the shared buffer its batch is to be written into (or None)
    and its place in the iteration; idle tasks while the window is full."""

    def __init__(self, chunks: Iterable[Chunk], buffers: BatchBuffers | None, window: Window | None) -> None:
        self.chunks = chunks
        self.buffers = buffers
        self.window = window

    def __iter__(self) -> Iterator[tuple[Chunk | None, int | None, int]]:
        # This runs at the DataLoader's first request for a task, after every worker has finished
        # or discarded the earlier iteration's tasks: their buffers are free again.
        if self.buffers is not None:
            self.buffers.release_all()
        if self.window is not None:
            self.window.reset()
        for sequence, chunk in enumerate(self.chunks):
            while self.window is not None and self.window.full():
                yield _IDLE  # the DataLoader sends a task for each result: never none, or it would end
            if self.window is not None:
                self.window.sent += 1
            yield chunk, self.buffers.claim() if self.buffers is not None else None, sequence  # claimed as sent


class Tasks(Dataset):
    """A "dataset" whose indices are batches of addresses: a DataLoader worker runs each one."""

    def __init__(self, worker: BatchWorker, buffers: BatchBuffers | None, window: Window | None) -> None:
        self.worker = worker
        self.buffers = buffers
        self.window = window

    def __getitem__(self, task: tuple[Chunk | None, int | None, int]) -> BatchResult:  # type: ignore[override]
        result = self._run(*task)
        if self.window is not None:
            self.window.finish(result.sequence)
        return result

    def _run(self, chunk: Chunk | None, buffer: int | None, sequence: int) -> BatchResult:
        if chunk is None:
            time.sleep(IDLE_SECONDS)
            return BatchResult()
        try:
            if buffer is None or self.buffers is None:
                result = self.worker(chunk)
            else:
                result = self.worker(chunk, functools.partial(self.buffers.collate, buffer, self.worker.collate))
        except Exception:  # raised in its turn, not as it arrives (the DataLoader is out of order)
            result = BatchResult(failure=compat.worker_failure(f"in loom.data worker process {os.getpid()}"))
        result.buffer, result.sequence = buffer, sequence
        return result


def in_sequence(results: Iterator[BatchResult], window: Window, stop: threading.Event) -> Iterator[BatchResult]:
    """Results in the order their tasks were sent, from results in the order they finished;
    they end once ``stop`` is set.

    Idle tasks' results are taken as soon as they are ready, even while earlier results wait to
    be handed out: each one taken sends a task, and left in the queue it would keep the workers
    without one while the loop trains on those earlier results (or past a pass's end). While
    they flow, torch never finds a worker that died (it looks after 5 s with no result), so the
    workers are looked at here, once a second of idle results."""
    early: dict[int, BatchResult] = {}
    looked = time.monotonic()
    while not stop.is_set():
        if window.handed in early and not window.idle_waiting():
            window.handed += 1
            yield early.pop(window.handed - 1)
            continue
        result = next(results, None)
        if result is None:
            return
        if result.sequence >= 0:
            early[result.sequence] = result
            continue
        window.idle_taken += 1
        if time.monotonic() - looked > DEAD_WORKER_CHECK_SECONDS:
            if dead := compat.dead_dataloader_workers(results):
                raise RuntimeError(f"loom.data worker process(es) {', '.join(map(str, dead))} exited unexpectedly; iterating again starts new ones")
            looked = time.monotonic()


def out_of_buffers(results: Iterator[BatchResult], buffers: BatchBuffers) -> Iterator[BatchResult]:
    """Results whose batches are views of their shared buffers (made by the receiver, off the loop's step)."""
    for result in results:
        if result.buffer is not None:
            result.data = buffers.read(result.buffer, result.data)
        yield result


def yield_to_training(worker_id: int) -> None:
    """Input workers run at a lower priority, so the training loop gets a core the moment it needs one."""
    os.nice(5)
