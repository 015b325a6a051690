"""Which elements each replica reads, batch by batch, computed on addresses alone.

An element's address is ``(shard, index)``. One epoch of a pipeline, for one replica, is a
sequence of batches of addresses, derived from the shards' lengths, the pipeline's index
operations, the epoch and the sharding; no file is opened. The index operations run in one
fixed order, the order tf.data's guide recommends:

    file order (shuffled) -> sharding by file -> interleave -> shuffle -> skip -> take -> repeat

Sharding (tf.data's AutoShardPolicy, decided by ``choose_sharding``):

* ``"sample"``: every replica computes the same global stream and takes the r-th slice of each
  global batch, with ``loom.data.sharding``'s rule for an uneven last batch. The global batches
  are the same whatever the number of replicas, so a position saved on N replicas resumes on M.
* ``"file"``: files are dealt to replicas by size, largest first, each to the replica with the
  fewest elements so far (files of equal size in the epoch's shuffled order, so they change
  replicas between epochs while every replica's share keeps its size); a replica reads only its
  files and shuffles its own stream. Only shares that fill the same number of batches qualify
  (``file_imbalance``): a replica pads at most its last batch, with its own first elements
  (reported as not valid). A position resumes on the same number of replicas only.
  ``skip``/``take`` counts are split over the replicas.

Addresses live in int32/int64 tensors (an element's flat number: its shard's offset plus its
index), never as a Python object per element, so a full permutation of a billion elements
plans in a few GB; a batch's addresses become ``(shard, index)`` pairs only when it is read.
A full permutation (``shuffle()`` without a buffer) is uniform whatever order it permutes, so
interleave's order is not built for it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from loom.data.seeding import mix
from loom.data.sharding import ShardPlan, buffer_shuffle, epoch_order, epoch_seed, index_dtype

Key = tuple[int, int]  # (shard, index within the shard)
SHARDINGS = ("auto", "file", "sample")
_BLOCK = 1 << 16  # addresses turned into Python ints at a time


@dataclass(frozen=True)
class IndexOps:
    """The pipeline's operations on addresses, in their fixed order."""

    shuffle: bool = False
    buffer: int | None = None  # None: a full permutation; n: a buffer of n elements (tf.data's)
    seed: int = 0
    cycle_length: int = 1  # interleave: shards read at once
    block_length: int = 1
    skip: int = 0
    take: int | None = None
    repeat: int | None = 1  # None: forever


@dataclass(frozen=True)
class Chunk:
    """One batch of addresses for one replica; the first ``valid`` are real, the rest padding.

    ``seed`` is what its maps draw random numbers from (``loom.data.seeding``).
    """

    keys: list[Key]
    valid: int
    seed: int = 0


def choose_sharding(
    policy: str, auto_shard: str, lengths: Sequence[int], ops: IndexOps, per_replica_batch: int, num_replicas: int
) -> str:
    """By file when asked, or when AUTO, the source suits it and the files split evenly; else by sample."""
    if policy not in SHARDINGS:
        raise ValueError(f"shard_by must be one of {SHARDINGS}, got {policy!r}")
    if policy == "sample" or (policy == "auto" and auto_shard != "file"):
        return "sample"
    if len(lengths) < num_replicas:
        if policy == "auto":
            return "sample"
        raise ValueError(
            f"shard_by='file' needs at least one file per replica: {len(lengths)} file(s) for {num_replicas} "
            "replicas; use shard_by='sample' or split the data into more files"
        )
    problem = file_imbalance(lengths, ops, per_replica_batch, num_replicas)
    if problem is None:
        return "file"
    if policy == "auto":
        return "sample"
    raise ValueError(f"shard_by='file' {problem}; use shard_by='sample' (or 'auto'), or files of more even size")


def file_imbalance(lengths: Sequence[int], ops: IndexOps, per_replica_batch: int, num_replicas: int) -> str | None:
    """Why dealing these files to the replicas is uneven, or None when every share fills the same batches.

    Shares that need different numbers of batches would make the shorter replicas train on
    padding (or, repeating forever, on their few elements more often than the rest).
    """
    plan = EpochPlan(lengths, ops, per_replica_batch, num_replicas, 0, "file")
    shares = plan.per_replica(0)
    if ops.repeat is not None:
        shares = [ops.repeat * n for n in shares]
    steps = [math.ceil(n / per_replica_batch) for n in shares]
    if len(set(steps)) == 1:
        return None
    short = steps.index(min(steps))
    return (
        f"deals the {len(lengths)} files unevenly: the replicas get {min(shares)} to {max(shares)} elements a pass, "
        f"so replica {short} would train on padding in {max(steps) - steps[short]} of its {max(steps)} steps"
    )


class EpochPlan:
    """The batches of addresses one replica reads in each pass over the pipeline."""

    def __init__(
        self,
        lengths: Sequence[int],
        ops: IndexOps,
        batch_size: int,
        num_replicas: int,
        replica: int,
        sharding: str,
        drop_remainder: bool = False,
    ) -> None:
        """``batch_size`` is the global batch under ``"sample"`` sharding and per replica under ``"file"``."""
        self.lengths = list(lengths)
        self.ends = list(itertools.accumulate(self.lengths))  # flat address of each shard's end
        self.total = self.ends[-1] if self.ends else 0
        self.ops = ops
        self.num_replicas = num_replicas
        self.replica = replica
        self.sharding = sharding
        self.drop_remainder = drop_remainder
        self.batch_size = batch_size
        self.replica_batch = batch_size // num_replicas if sharding == "sample" else batch_size

    # ---- sizes ---------------------------------------------------------------------------
    def num_batches(self, epoch: int) -> int | None:
        """Batches per pass on every replica; None when the pipeline repeats forever."""
        if self.ops.repeat is None:
            return None
        if self.sharding == "sample":
            return len(self._sample_plan())
        totals = [self.ops.repeat * n for n in self.per_replica(epoch)]
        if self.drop_remainder:
            return min(totals) // self.batch_size
        return math.ceil(max(totals) / self.batch_size)

    def _sample_plan(self) -> ShardPlan:
        """Global batches of one finite pass sharded by sample."""
        assert self.ops.repeat is not None
        total = self.ops.repeat * _take_skip(self.total, self.ops.skip, self.ops.take)
        return ShardPlan(total, self.batch_size, self.num_replicas, self.drop_remainder)

    def per_replica(self, sub_epoch: int) -> list[int]:
        """Elements each replica reads in one repetition (after its skip/take share); the same every repetition."""
        assignment = self._assign_files(sub_epoch)
        return [
            _take_skip(sum(self.lengths[f] for f in files), *self._share(r))
            for r, files in enumerate(assignment)
        ]

    # ---- batches ---------------------------------------------------------------------------
    def batches(self, epoch: int, start: int = 0) -> Iterator[Chunk]:
        """This replica's batches of pass ``epoch``, from batch ``start`` on (for resuming)."""
        if self.sharding == "sample":
            yield from self._sample_batches(epoch, start)
        else:
            yield from self._file_batches(epoch, start)

    def _sample_batches(self, epoch: int, start: int) -> Iterator[Chunk]:
        stream = itertools.chain.from_iterable(self._stream(sub, None) for sub in self._sub_epochs(epoch))
        stream = itertools.islice(stream, start * self.batch_size, None)
        count = self.num_batches(epoch)
        if count is None:  # endless: every global batch is full
            size, lo = self.replica_batch, self.replica * self.replica_batch
            for batch in itertools.count(start):
                block = list(itertools.islice(stream, self.batch_size))
                yield self._chunk(block[lo : lo + size], size, epoch, batch)
        plan = self._sample_plan()
        for batch in range(start, count):
            block = list(itertools.islice(stream, plan.batch_size_of(batch)))
            mine = plan.slice_of_batch(block, batch, self.replica)
            yield self._chunk(mine, plan.valid_count(batch, self.replica), epoch, batch)

    def _file_batches(self, epoch: int, start: int) -> Iterator[Chunk]:
        stream = itertools.chain.from_iterable(
            self._stream(sub, self.replica) for sub in self._sub_epochs(epoch)
        )
        count = self.num_batches(epoch)
        first: list[int] = []  # the first batch's addresses, kept to pad a short last batch
        batch = 0
        while count is None or batch < count:
            block = list(itertools.islice(stream, self.batch_size))
            if batch == 0:
                first = block
            if batch >= start:
                valid = len(block)
                if valid < self.batch_size:
                    block += (first * (self.batch_size // max(len(first), 1) + 1))[: self.batch_size - valid]
                yield self._chunk(block, valid, epoch, batch)
            batch += 1

    def _chunk(self, addresses: list[int], valid: int, epoch: int, batch: int) -> Chunk:
        """Flat addresses as ``(shard, index)`` pairs, with the batch's own seed."""
        keys = []
        for address in addresses:
            shard = bisect.bisect_right(self.ends, address)
            keys.append((shard, address - (self.ends[shard] - self.lengths[shard])))
        return Chunk(keys, valid, mix(self.ops.seed, self.replica, epoch, batch))

    # ---- the stream of one repetition ----------------------------------------------------------
    def _sub_epochs(self, epoch: int) -> Iterator[int]:
        """Seeds of the repetitions inside one pass: pass e of repeat(k) covers e*k .. e*k+k-1."""
        if self.ops.repeat is None:
            return itertools.count()
        return iter(range(epoch * self.ops.repeat, (epoch + 1) * self.ops.repeat))

    def _stream(self, sub_epoch: int, replica: int | None) -> Iterator[int]:
        """Flat addresses of one repetition: of all files (``replica=None``) or of one replica's share."""
        if replica is None:
            files = self._file_order(sub_epoch).tolist()
            skip, take = self.ops.skip, self.ops.take
            rng_seed = epoch_seed(self.ops.seed, sub_epoch)
        else:
            files = self._assign_files(sub_epoch)[replica]
            skip, take = self._share(replica)
            rng_seed = epoch_seed(self.ops.seed, sub_epoch) * 1_009 + replica
        stop = None if take is None else skip + take
        if self.ops.shuffle and self.ops.buffer is None:
            generator = torch.Generator().manual_seed(random.Random(rng_seed).getrandbits(62))
            return _ints(self._permuted(files, generator)[skip:stop])
        keys = _interleave(files, self.lengths, self.ends, self.ops.cycle_length, self.ops.block_length)
        if self.ops.shuffle:
            keys = buffer_shuffle(keys, self.ops.buffer, random.Random(rng_seed))
        return itertools.islice(keys, skip, stop)

    def _permuted(self, files: list[int], generator: torch.Generator) -> torch.Tensor:
        """A random permutation of every flat address of ``files``, in one int tensor (4 or 8 bytes each).

        Positions in ``files`` read one after another are permuted, then mapped to addresses in
        place, a block at a time, so the plan never holds more than the permutation. The mapping
        runs in NumPy, on this thread: torch would run it in its thread pool, which waits for the
        cores the input workers hold (30 ms for 4,000 addresses on 2 busy cores, not 0.1).
        """
        dtype = index_dtype(self.total)
        ends = np.cumsum([self.lengths[f] for f in files], dtype=np.int64)  # where each file ends among the positions
        shift = np.array([self.ends[f] for f in files], dtype=np.int64) - ends  # address - position
        positions = torch.randperm(int(ends[-1]) if len(files) else 0, generator=generator, dtype=dtype)
        flat = positions.numpy()
        for start in range(0, len(flat), _BLOCK):
            block = flat[start : start + _BLOCK]
            block += shift[np.searchsorted(ends, block, side="right")].astype(block.dtype)
        return positions

    def _file_order(self, sub_epoch: int) -> torch.Tensor:
        return epoch_order(len(self.lengths), self.ops.shuffle, self.ops.seed, sub_epoch)

    def _assign_files(self, sub_epoch: int) -> list[list[int]]:
        """Deal the files to replicas: largest first, each to the replica with the fewest elements.

        Files of equal size go in the epoch's order, so every replica's share has the same size
        in every epoch (``file_imbalance`` holds for all) while the files themselves move.
        """
        order = self._file_order(sub_epoch).tolist()
        rank = {f: position for position, f in enumerate(order)}
        shares: list[list[int]] = [[] for _ in range(self.num_replicas)]
        loads = [(0, 0, r) for r in range(self.num_replicas)]  # (elements, files, replica): a heap
        for f in sorted(order, key=lambda f: -self.lengths[f]):
            size, count, r = heapq.heappop(loads)
            shares[r].append(f)
            heapq.heappush(loads, (size + self.lengths[f], count + 1, r))
        return [sorted(files, key=rank.__getitem__) for files in shares]

    def _share(self, replica: int) -> tuple[int, int | None]:
        """This replica's part of the global skip and take counts under file sharding."""

        def part(n: int) -> int:
            return n // self.num_replicas + (1 if replica < n % self.num_replicas else 0)

        return part(self.ops.skip), None if self.ops.take is None else part(self.ops.take)


def _take_skip(length: int, skip: int, take: int | None) -> int:
    remaining = max(0, length - skip)
    return remaining if take is None else min(take, remaining)


def _ints(addresses: torch.Tensor) -> Iterator[int]:
    """A tensor's values as Python ints, a block at a time (never a Python list of all of them)."""
    for start in range(0, len(addresses), _BLOCK):
        yield from addresses[start : start + _BLOCK].tolist()


def _interleave(files: list[int], lengths: list[int], ends: list[int], cycle: int, block: int) -> Iterator[int]:
    """tf.data's interleave: ``cycle`` files open at once, ``block`` elements from each in turn."""
    if cycle == 1:  # one file after another
        return (address for f in files for address in range(ends[f] - lengths[f], ends[f]))
    return _round_robin(files, lengths, ends, cycle, block)


def _round_robin(files: list[int], lengths: list[int], ends: list[int], cycle: int, block: int) -> Iterator[int]:
    pending = iter(files)
    open_: list[list[int]] = []  # [next address, end address]
    for f in itertools.islice(pending, cycle):
        open_.append([ends[f] - lengths[f], ends[f]])
    while open_:
        for slot in list(open_):
            address, end = slot
            stop = min(address + block, end)
            yield from range(address, stop)
            slot[0] = stop
            if stop >= end:
                nxt = next(pending, None)
                if nxt is None:
                    open_.remove(slot)
                else:
                    slot[:] = [ends[nxt] - lengths[nxt], ends[nxt]]
