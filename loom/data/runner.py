"""Runs a pipeline for one replica: plan the epoch, read and map in workers, prefetch, time it.

The work of a batch is one task for a worker (``loom.data.batch_worker``). Thread workers are
``torchdata.nodes`` (``ParallelMapper``, ``Prefetcher``, ``PinMemory``); process workers are a
``DataLoader`` whose indices are batches of addresses (``loom.data.process_workers``). On CUDA
batches arrive pinned and the copy to the device is issued one batch ahead, without blocking.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.dataloader import default_collate
from torchdata.nodes import BaseNode, Loader, ParallelMapper, PinMemory, Prefetcher

from loom.data.batch_worker import BatchResult, BatchWorker, first
from loom.data.loader import own_generator, to_device
from loom.data.plan import Chunk, EpochPlan, choose_sharding
from loom.data.process_workers import HELD_BATCHES, RECEIVED_AHEAD, Claims, Tasks, Window, in_sequence, out_of_buffers, yield_to_training
from loom.data.receiver import Receiver
from loom.data.report import InputStats
from loom.data.seeding import mix
from loom.data.shared_batches import BatchBuffers
from loom.data.sharding import check_global_batch
from loom.errors import DataFileError

if TYPE_CHECKING:
    from loom.data.pipeline import Pipeline

class PipelineLoader:
    """One replica's batches of a pipeline, resumable, with a record of where time goes.

    ``len()`` is the number of steps per pass, the same on every replica. Iterating again
    continues from the current position: the next epoch after a full pass, the rest of the
    pass after a ``break`` or a ``load_state_dict``.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        num_replicas: int,
        replica: int,
        device: torch.device,
        batch_size: int | None,
        shard_by: str,
    ) -> None:
        self.pipeline = pipeline
        self.device = device
        self.num_replicas = num_replicas
        self.batched = (batch_size or pipeline.batch_size) is not None
        if not self.batched and num_replicas > 1:
            raise ValueError("distribute() needs batch_size= (the global batch) or a pipeline ending in .batch(n)")
        self.global_batch = batch_size or pipeline.batch_size or 1
        self.per_replica_batch = check_global_batch(self.global_batch, num_replicas)
        source = pipeline.source
        lengths = source.lengths()
        if not sum(lengths):
            raise ValueError(f"the pipeline's source ({len(lengths)} shard(s)) holds no elements")
        self.sharding = choose_sharding(
            shard_by, source.auto_shard, lengths, pipeline.ops, self.per_replica_batch, num_replicas
        )
        plan_batch = self.global_batch if self.sharding == "sample" else self.per_replica_batch
        self.plan = EpochPlan(
            lengths, pipeline.ops, plan_batch, num_replicas, replica, self.sharding, pipeline.drop_remainder
        )
        self.workers = _parallelism(pipeline.num_parallel)
        if pipeline.cache_after is not None and pipeline.method == "process" and self.workers:
            raise ValueError("cache() needs thread workers: process workers do not share a cache; use method='thread'")
        collate = (pipeline.collate_fn or default_collate) if self.batched else first
        # Thread workers share the process's generators: only processes (or no workers) seed per batch.
        own_generators = pipeline.method == "process" or not self.workers
        self._worker = BatchWorker(source, pipeline.maps, pipeline.cache_after, collate, own_generators)
        self.stats = InputStats(
            stages=["read"] + [m.name for m in pipeline.maps] + ["collate"],
            workers=self.workers,
            method=pipeline.method,
            prefetch=self._prefetch_depth(),
            cached=pipeline.cache_after is not None,
        )
        self.epoch = 0
        self.position = 0  # batches of the current pass already handed out
        # Process workers in order run on into the next pass while the loop finishes this one, so
        # no pass starts with an empty pipeline. Out of order a pass's batches would mix; thread
        # workers still reading when the interpreter exits would abort it.
        self._chunks = _Chunks(self.plan, onward=pipeline.deterministic and self._in_processes)
        self._workers: Iterable[BatchResult] | None = None
        self._stream: Iterator[BatchResult] | None = None  # the workers' results, from _stream_next on
        self._stream_next: tuple[int, int] | None = None  # (pass, batch) of the stream's next result
        self._buffers: BatchBuffers | None = None  # process workers on CPU: batches in shared buffers
        self._window: Window | None = None  # process workers in order: how far tasks run ahead
        self._valid: list[int] = []  # per batch of the current iteration
        self._warn_skipped(source.skipped, "file(s)")

    @property
    def _in_processes(self) -> bool:
        return self.pipeline.method == "process" and self.workers > 0

    # ---- sizes and positions -----------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int | None:
        return self.plan.num_batches(self.epoch)

    def __len__(self) -> int:
        steps = self.steps_per_epoch
        if steps is None:
            raise TypeError("a pipeline that repeats forever has no length")
        return steps

    def set_epoch(self, epoch: int) -> None:
        """Start pass ``epoch`` from its beginning (unless already positioned inside it)."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def valid_count(self, batch: int) -> int:
        """Real (not padding, not skipped) samples in the ``batch``-th batch of this iteration."""
        return self._valid[batch] if batch < len(self._valid) else self.per_replica_batch

    def state_dict(self) -> dict[str, Any]:
        """The position: pass and batches handed out, with what it is valid for."""
        return {
            "epoch": self.epoch,
            "batch": self.position,
            "num_replicas": self.num_replicas,
            "sharding": self.sharding,
            "global_batch": self.global_batch,
            "elements": sum(self.plan.lengths),
            "shards": len(self.plan.lengths),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly at the saved position; a clear error where that is impossible."""
        here = self.state_dict()
        if (state["elements"], state["shards"]) != (here["elements"], here["shards"]):
            raise ValueError(
                f"the saved input position is for {state['elements']} elements in {state['shards']} shard(s); "
                f"this pipeline has {here['elements']} in {here['shards']}: it is not the same data"
            )
        if state["global_batch"] != self.global_batch:
            raise ValueError(
                f"the saved input position counts global batches of {state['global_batch']}; this run uses "
                f"{self.global_batch}: resume with the same global batch size"
            )
        if "file" in (state["sharding"], self.sharding) and state["num_replicas"] != self.num_replicas:
            raise ValueError(
                f"the saved input position was sharded by file over {state['num_replicas']} replicas; it resumes "
                f"only on {state['num_replicas']} (here {self.num_replicas}). Sharding by sample "
                "(shard_by='sample') resumes on any number of replicas"
            )
        self.epoch, self.position = state["epoch"], state["batch"]

    def report(self) -> str:
        """Where the input time goes, and whether the training loop waits for it."""
        return self.stats.report()

    # ---- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if self.position and self.position == self.steps_per_epoch:  # read to its end by zip(range(n), loader)
            self.epoch, self.position = self.epoch + 1, 0
        epoch, start = self.epoch, self.position
        self._valid = []
        skipped: list[DataFileError] = []
        pending: tuple[Any, int] | None = None  # CUDA: the next batch, its copy already issued
        for result in self._results(epoch, start):
            skipped += result.skipped
            if self.device.type != "cuda":  # no copy to overlap: none at all on CPU
                batch = result.data if self.device.type == "cpu" else to_device(result.data, self.device)
                yield self._hand_out(batch, result.valid)
                continue
            if pending is not None:
                yield self._hand_out(*pending)
            pending = (to_device(result.data, self.device, non_blocking=True), result.valid)
        if pending is not None:
            yield self._hand_out(*pending)
        self.epoch, self.position = epoch + 1, 0
        self._warn_skipped(skipped, "sample(s)")

    def _hand_out(self, batch: Any, valid: int) -> Any:
        self._valid.append(valid)
        self.position += 1
        return batch

    def _results(self, epoch: int, start: int) -> Iterator[BatchResult]:
        """Workers' results in order, timing how long the consumer waits and trains."""
        count = self.plan.num_batches(epoch)
        stream = self._stream_from(epoch, start)
        waited_since = time.perf_counter()
        taken = itertools.islice(stream, None if count is None else max(count - start, 0))
        for batch in itertools.count(start):
            try:
                result = next(taken, None)
            except (Exception, KeyboardInterrupt) as error:  # a map raised, or a worker died: the stream is spent
                self._stream_next = None
                if not self._in_processes or not isinstance(error, KeyboardInterrupt):
                    # A reset torchdata mapper could drop the next batch after a failure, and a
                    # DataLoader that lost a worker cannot be reset: the next pass starts new workers.
                    self._drop_workers()
                raise
            if result is None:
                if not self._chunks.onward:  # take the stream's end too: threads left mid-stream abort the exit
                    next(stream, None)
                return
            got = time.perf_counter()
            self._stream_next = self._position_after(epoch, batch, count)
            if result.error is not None or result.failure is not None:
                self._stream_next = None  # the next iteration starts the workers' stream afresh
                if result.failure is not None:
                    result.failure.reraise()
                raise result.error
            self.stats.record_batch(result.seconds, got - waited_since)
            yield result
            waited_since = time.perf_counter()
            self.stats.record_step(waited_since - got)

    def _drop_workers(self) -> None:
        """Let go of the workers, their stream and its buffers; the receiver's thread ends on its own
        (its DataLoader may be waiting for a batch that a dead worker took with it)."""
        if isinstance(self._stream, Receiver):
            self._stream.stop()
        self._workers = self._stream = self._window = self._buffers = None

    def _stream_from(self, epoch: int, start: int) -> Iterator[BatchResult]:
        """The running stream where it is at (epoch, start), else one started there; restarting
        discards what the workers had read ahead for another position."""
        if self._stream is None or self._stream_next != (epoch, start):
            if isinstance(self._stream, Receiver):
                self._stream.close()  # out of the DataLoader's iterator before it is reset
            if self._workers is None:
                self._workers = self._start_workers()
            self._chunks.epoch, self._chunks.start = epoch, start
            self._stream = iter(self._workers)
            stop = threading.Event()
            if self._window is not None:
                self._stream = in_sequence(self._stream, self._window, stop)
            if self._buffers is not None:
                self._stream = out_of_buffers(self._stream, self._buffers)
            if self._in_processes:
                self._stream = Receiver(self._stream, RECEIVED_AHEAD, stop)
            self._stream_next = (epoch, start)
        return self._stream

    def _position_after(self, epoch: int, batch: int, count: int | None) -> tuple[int, int] | None:
        """Where the stream is once ``batch`` of pass ``epoch`` is taken; None where it ends there."""
        if batch + 1 != count:
            return epoch, batch + 1
        return (epoch + 1, 0) if self._chunks.onward else None

    def _start_workers(self) -> Iterable[BatchResult]:
        """Built once and reused every epoch, so worker threads and processes persist.

        Processes: a ``DataLoader`` whose "indices" are our batches of addresses (persistent
        workers, shared-memory tensors, pinning), handing results out as they finish. In order
        it ties each task to a worker when sent, so a worker ahead waits, its share done, behind
        a slower one (idle 2-3 ms of a 22 ms batch); here the order is restored instead, with
        tasks sent at most a window ahead of the oldest unfinished one, and never more than the
        window and the DataLoader's share ahead of the batch the receiver is to take next. Threads:
        ``torchdata.nodes``.
        """
        depth = self._prefetch_depth()
        if self._in_processes:
            factor = max(1, -(-depth // self.workers))
            # The DataLoader keeps workers x factor tasks unanswered; a window as large again lets
            # answered ones wait for a slower batch without stopping the workers ahead of it.
            in_flight = self.workers * factor
            ahead = 3 * in_flight if self.pipeline.deterministic else in_flight  # at most, past the loop
            if self.device.type == "cpu":  # elsewhere batches are copied anyway (pinned, to the device)
                self._buffers = BatchBuffers(ahead + HELD_BATCHES)
            if self.pipeline.deterministic:
                self._window = Window(2 * in_flight, ahead, self.workers)
            return DataLoader(
                Tasks(self._worker, self._buffers, self._window),
                batch_size=None,
                sampler=Claims(self._chunks, self._buffers, self._window),
                num_workers=self.workers,
                collate_fn=_as_is,
                pin_memory=self.device.type == "cuda",
                prefetch_factor=factor,
                persistent_workers=True,
                in_order=False,
                worker_init_fn=yield_to_training,
                generator=own_generator(mix(self.pipeline.ops.seed, self.plan.replica)),
            )
        node: BaseNode = ParallelMapper(
            _ChunkNode(self._chunks),
            self._worker,
            num_workers=self.workers,
            in_order=self.pipeline.deterministic,
            max_concurrent=self.workers or None,
        )
        if self.device.type == "cuda":
            node = PinMemory(node)
        if depth:
            node = Prefetcher(node, prefetch_factor=depth)
        return Loader(node)

    def _prefetch_depth(self) -> int:
        depth = self.pipeline.prefetch_depth
        if depth == "auto":
            # A process worker's finished batch counts against its DataLoader share until the loop
            # takes it: four each keep a task queued while the loop trains on a batch or two (two
            # each left the workers idle 13% of a step balanced with the input).
            per_worker = 4 if self._in_processes else 2
            return per_worker * max(self.workers, 1)
        return depth or 0

    def _warn_skipped(self, skipped: list[DataFileError], what: str) -> None:
        if skipped:
            warnings.warn(
                f"loom.data skipped {len(skipped)} unreadable {what} (errors='skip'); first: {skipped[0]}",
                stacklevel=3,
            )


class _Chunks(Sampler[Chunk]):
    """Batches of addresses from the position set before each iteration; ``onward``, on through
    the passes after it."""

    def __init__(self, plan: EpochPlan, onward: bool) -> None:
        self.plan = plan
        self.onward = onward
        self.epoch = 0
        self.start = 0

    def __iter__(self) -> Iterator[Chunk]:
        epoch, start = self.epoch, self.start
        while True:
            yield from self.plan.batches(epoch, start)
            if not self.onward or not self.plan.num_batches(epoch + 1):  # no batches: nothing to run on into
                return
            epoch, start = epoch + 1, 0


class _ChunkNode(BaseNode[Chunk]):
    """``_Chunks`` as a ``torchdata.nodes`` source; each reset starts the current pass."""

    def __init__(self, chunks: _Chunks) -> None:
        super().__init__()
        self.chunks = chunks
        self._it: Iterator[Chunk] = iter(())

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._it = iter(self.chunks)

    def next(self) -> Chunk:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        return {}  # the position lives in PipelineLoader.state_dict


def _as_is(result: BatchResult) -> BatchResult:
    return result


def _parallelism(num_parallel: int | str | None) -> int:
    """Worker count: 0 runs the maps in the consumer's thread; ``auto`` is this process's core budget."""
    if num_parallel == "auto":
        return torch.get_num_threads()
    return num_parallel or 0  # type: ignore[return-value]
