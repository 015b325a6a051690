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
* ``"file"``: each epoch the shuffled files are dealt to replicas, each to the replica with the
  fewest elements so far; a replica reads only its files and shuffles its own stream. Replicas
  whose share is shorter pad their last batches with their own first elements (reported as not
  valid), so all run the same number of steps. A position resumes on the same number of
  replicas only. ``skip``/``take`` counts are split over the replicas.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from loom.data.sharding import ShardPlan, buffer_shuffle, epoch_order, epoch_seed

Key = tuple[int, int]  # (shard, index within the shard)
SHARDINGS = ("auto", "file", "sample")


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
    """One batch of addresses for one replica; the first ``valid`` are real, the rest padding."""

    keys: list[Key]
    valid: int


def choose_sharding(policy: str, auto_shard: str, num_shards: int, num_replicas: int) -> str:
    """By file when asked, or when AUTO and the source has at least one shard per replica."""
    if policy not in SHARDINGS:
        raise ValueError(f"shard_by must be one of {SHARDINGS}, got {policy!r}")
    if policy == "file" and num_shards < num_replicas:
        raise ValueError(
            f"shard_by='file' needs at least one file per replica: {num_shards} file(s) for {num_replicas} "
            "replicas; use shard_by='sample' or split the data into more files"
        )
    if policy == "auto":
        return "file" if auto_shard == "file" and num_shards >= num_replicas else "sample"
    return policy


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
        totals = [sum(col) for col in zip(*(self._per_replica(sub) for sub in self._sub_epochs(epoch)))]
        if self.drop_remainder:
            return min(totals) // self.batch_size
        return math.ceil(max(totals) / self.batch_size)

    def _sample_plan(self) -> ShardPlan:
        """Global batches of one finite pass sharded by sample."""
        assert self.ops.repeat is not None
        total = self.ops.repeat * _take_skip(sum(self.lengths), self.ops.skip, self.ops.take)
        return ShardPlan(total, self.batch_size, self.num_replicas, self.drop_remainder)

    def _per_replica(self, sub_epoch: int) -> list[int]:
        """Elements each replica reads in one repetition (after its skip/take share)."""
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
            while True:
                block = list(itertools.islice(stream, self.batch_size))
                yield Chunk(block[lo : lo + size], size)
        plan = self._sample_plan()
        for batch in range(start, count):
            block = list(itertools.islice(stream, plan.batch_size_of(batch)))
            yield Chunk(plan.slice_of_batch(block, batch, self.replica), plan.valid_count(batch, self.replica))

    def _file_batches(self, epoch: int, start: int) -> Iterator[Chunk]:
        stream = itertools.chain.from_iterable(
            self._stream(sub, self.replica) for sub in self._sub_epochs(epoch)
        )
        count = self.num_batches(epoch)
        mine: list[Key] = []  # the first batch's keys, kept to pad a short share
        batch = 0
        while count is None or batch < count:
            block = list(itertools.islice(stream, self.batch_size))
            if batch == 0:
                mine = block
            if batch >= start:
                valid = len(block)
                if valid < self.batch_size:
                    block += (mine * (self.batch_size // max(len(mine), 1) + 1))[: self.batch_size - valid]
                if not block:
                    raise RuntimeError("a replica's share of the files is empty; use shard_by='sample'")
                yield Chunk(block, valid)
            batch += 1

    # ---- the stream of one repetition ----------------------------------------------------------
    def _sub_epochs(self, epoch: int) -> Iterator[int]:
        """Seeds of the repetitions inside one pass: pass e of repeat(k) covers e*k .. e*k+k-1."""
        if self.ops.repeat is None:
            return itertools.count()
        return iter(range(epoch * self.ops.repeat, (epoch + 1) * self.ops.repeat))

    def _stream(self, sub_epoch: int, replica: int | None) -> Iterator[Key]:
        """Addresses of one repetition: of all files (``replica=None``) or of one replica's share."""
        if replica is None:
            files = self._file_order(sub_epoch)
            skip, take = self.ops.skip, self.ops.take
            rng_seed = epoch_seed(self.ops.seed, sub_epoch)
        else:
            files = self._assign_files(sub_epoch)[replica]
            skip, take = self._share(replica)
            rng_seed = epoch_seed(self.ops.seed, sub_epoch) * 1_009 + replica
        keys = _interleave(files, self.lengths, self.ops.cycle_length, self.ops.block_length)
        if self.ops.shuffle:
            keys = _shuffle(keys, self.ops.buffer, random.Random(rng_seed))
        stop = None if take is None else skip + take
        return itertools.islice(keys, skip, stop)

    def _file_order(self, sub_epoch: int) -> list[int]:
        return epoch_order(len(self.lengths), self.ops.shuffle, self.ops.seed, sub_epoch)

    def _assign_files(self, sub_epoch: int) -> list[list[int]]:
        """Deal the epoch's files to replicas, each to the one with the fewest elements so far."""
        shares: list[list[int]] = [[] for _ in range(self.num_replicas)]
        sizes = [0] * self.num_replicas
        for f in self._file_order(sub_epoch):
            r = min(range(self.num_replicas), key=lambda i: (sizes[i], len(shares[i]), i))
            shares[r].append(f)
            sizes[r] += self.lengths[f]
        return shares

    def _share(self, replica: int) -> tuple[int, int | None]:
        """This replica's part of the global skip and take counts under file sharding."""

        def part(n: int) -> int:
            return n // self.num_replicas + (1 if replica < n % self.num_replicas else 0)

        return part(self.ops.skip), None if self.ops.take is None else part(self.ops.take)


def _take_skip(length: int, skip: int, take: int | None) -> int:
    remaining = max(0, length - skip)
    return remaining if take is None else min(take, remaining)


def _interleave(files: list[int], lengths: list[int], cycle: int, block: int) -> Iterator[Key]:
    """tf.data's interleave: ``cycle`` files open at once, ``block`` elements from each in turn."""
    if cycle == 1:  # one file after another
        return ((shard, index) for shard in files for index in range(lengths[shard]))
    return _round_robin(files, lengths, cycle, block)


def _round_robin(files: list[int], lengths: list[int], cycle: int, block: int) -> Iterator[Key]:
    pending = iter(files)
    open_: list[list[int]] = []  # [shard, next index]
    for f in itertools.islice(pending, cycle):
        open_.append([f, 0])
    while open_:
        for slot in list(open_):
            shard, i = slot
            stop = min(i + block, lengths[shard])
            for index in range(i, stop):
                yield (shard, index)
            slot[1] = stop
            if stop >= lengths[shard]:
                nxt = next(pending, None)
                if nxt is None:
                    open_.remove(slot)
                else:
                    slot[:] = [nxt, 0]


def _shuffle(keys: Iterator[Key], buffer: int | None, rng: random.Random) -> Iterator[Key]:
    """A full permutation (``buffer=None``; addresses are small) or tf.data's buffer shuffle."""
    if buffer is None:
        everything = list(keys)
        generator = torch.Generator().manual_seed(rng.getrandbits(62))
        return iter([everything[i] for i in torch.randperm(len(everything), generator=generator).tolist()])
    return buffer_shuffle(keys, buffer, rng)

