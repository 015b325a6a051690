"""Gradient compression for the all-reduce, as DDP communication hooks, and the choice among them.

Kept apart from the strategies (like tf.distribute's CrossDeviceOps): a strategy takes the
choice as an argument. Three ways to send a step's gradients:

- ``"bf16"`` / ``"fp16"``: each bucket cast down, pre-divided by the group size (so the sum
  stays in range), reduced, and cast back into the fp32 gradients: half the bytes. DDP's own
  ``bf16_compress_hook`` refuses to run without CUDA and NCCL, although gloo reduces bf16 on
  CPU, hence a hook of our own.
- ``"powersgd"`` (or a ``PowerSGD(...)``): a rank-r approximation of every gradient matrix with
  error feedback, a few percent of the bytes (``PowerSGDHook``: torch's algorithm, laid out for
  one CPU thread).
- ``"auto"``: the lightest of these whose estimated time on the measured link fits a step's
  budget (``choose_compression``), said in one line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Union

import torch
import torch.distributed as dist

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def cast_allreduce_hook(dtype: torch.dtype) -> Hook:
    """A DDP comm hook that all-reduces each gradient bucket in ``dtype``."""

    def compressed_allreduce(process_group, bucket):  # annotations omitted: DDP checks them literally
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(done: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(decompress)

    return compressed_allreduce


@dataclass(frozen=True)
class PowerSGD:
    """PowerSGD gradient compression (Vogels et al., 2019), the algorithm of torch's ``powerSGD_hook``.

    Args:
        rank: rank of each gradient matrix's approximation; 1-4 is usual, higher is closer to exact.
        error_feedback: add what compression left out of a step to the next step's gradient;
            without it PowerSGD's bias slows convergence.
        start_iter: steps all-reduced uncompressed first, while gradients change fast (torch
            suggests about 1,000 for long runs; at least 2 with error feedback or warm start).
        warm_start: reuse the last step's factor as the starting point of the next.
    """

    rank: int = 2
    error_feedback: bool = True
    start_iter: int = 10
    warm_start: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"PowerSGD(rank=...) must be a positive integer, got {self.rank!r}")
        if (self.error_feedback or self.warm_start) and self.start_iter < 2:
            raise ValueError(
                f"PowerSGD(start_iter={self.start_iter}) must be at least 2 with error_feedback or warm_start "
                "(DDP re-buckets the gradients after the first step; their errors and factors are kept per bucket)"
            )

    def hook(self, group: Any = None) -> tuple[Hook, Any]:
        """The DDP hook and the state it keeps (error feedback, warm-start factors, step count)."""
        return powersgd_hook, PowerSGDHook(self, group)

    def compressed_bytes(self, shapes: Iterable[torch.Size], element_size: int = 4) -> int:
        """Bytes one replica sends per step: P and Q for matrices it compresses, the rest as is.

        torch's hook views each gradient as (rows, everything else) and compresses it when
        that saves at least half (``min_compression_rate=2``).
        """
        total = 0
        for shape in shapes:
            numel = int(torch.Size(shape).numel())
            if len(shape) > 1:
                rows, cols = shape[0], numel // shape[0]
                low_rank = (rows + cols) * min(self.rank, rows, cols)
                if numel >= 2 * low_rank:
                    total += low_rank
                    continue
            total += numel
        return total * element_size


class PowerSGDHook:
    """PowerSGD for DDP's comm hook: one bucket's gradient matrices sent as P (rows x r) and Q (cols x r).

    torch's ``powerSGD_hook`` runs this algorithm too, but on one CPU thread it costs about as
    much as the model's backward pass (W1, under load: about 130 ms a step against 45 ms here): it
    multiplies by the transposed gradient (``M^T P``, a strided walk ten times slower than
    ``P^T M``) and allocates two gradient-sized tensors a step for error feedback. It also waits for
    its second all-reduce inside the first one's callback, which deadlocks gloo's two worker threads
    when two buckets are in flight. Here Q is kept transposed, the error is M - P Q^T in one fused
    pass into a kept buffer, and every collective is started and waited for in the hook, on the
    backward pass's thread, bucket by bucket: the same order on every replica.

    Per bucket and step (after ``start_iter`` uncompressed steps): add the error; P = M Q for every
    matrix; all-reduce P with the gradients left uncompressed (vectors, matrices that would not
    shrink by half; those leave no error); orthonormalize P; Q = M^T P; all-reduce Q; the gradient
    is P Q^T / N.
    """

    def __init__(self, config: PowerSGD, group: Any = None) -> None:
        self.config = config
        self.group = group
        self.iter = 0  # backward passes seen; compression starts at config.start_iter
        self.error: dict[int, torch.Tensor] = {}  # bucket index -> what compression left out last step
        self.factors: dict[int, list[torch.Tensor]] = {}  # bucket index -> each matrix's Q^T (r x cols), warm start
        self._rng = torch.Generator().manual_seed(0)  # the same random factors on every replica

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """This bucket's gradients, averaged over the replicas through their low-rank factors."""
        group = self.group if self.group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        future = torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
        with torch.no_grad():
            if self.iter < self.config.start_iter:  # plain averaged fp32 while gradients change fast
                dist.all_reduce(buffer, group=group)
                buffer.div_(dist.get_world_size(group))
            else:
                self._compress_and_reduce(bucket.index(), buffer, bucket.gradients(), group)
        if bucket.is_last():
            self.iter += 1
        future.set_result(buffer)
        return future

    def _compress_and_reduce(self, index: int, buffer: torch.Tensor, grads: list[torch.Tensor], group: Any) -> None:
        world = dist.get_world_size(group)
        feedback = self.config.error_feedback
        if feedback:
            if index in self.error:
                buffer.add_(self.error[index])
            else:
                self.error[index] = torch.zeros_like(buffer)
        matrices, rest = self._split(grads)
        qts = self._factors(index, matrices, buffer)
        ps = [torch.matmul(m, qt.t()) for m, qt in zip(matrices, qts)]
        sent = torch.cat([*(p.view(-1) for p in ps), *(g.view(-1) for g in rest)]) if ps or rest else buffer.new_empty(0)
        dist.all_reduce(sent, group=group)
        at = sum(p.numel() for p in ps)
        for g in rest:  # the uncompressed gradients, averaged: nothing left out, their error stays 0
            g.copy_(sent[at:at + g.numel()].view_as(g)).div_(world)
            at += g.numel()
        at = 0
        for p in ps:  # the summed P, orthonormalized (its scale does not matter)
            p.copy_(_orthonormal(sent[at:at + p.numel()].view_as(p)))
            at += p.numel()
        if qts:
            flat = torch.cat([torch.matmul(p.t(), m).view(-1) for p, m in zip(ps, matrices)])
            dist.all_reduce(flat, group=group)
            flat.div_(world)
            at = 0
            for qt, p, m in zip(qts, ps, matrices):
                qt.copy_(flat[at:at + qt.numel()].view_as(qt))
                at += qt.numel()
                if feedback:  # error = M - P Q^T in one pass, before M is overwritten
                    torch.addmm(m, p, qt, alpha=-1, out=self._error_of(index, buffer, m))
                torch.matmul(p, qt, out=m)  # the approximation, written into the gradient

    def _error_of(self, index: int, buffer: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The part of the bucket's error that lines up with ``grad`` (a view into the bucket's buffer)."""
        at = grad.storage_offset() - buffer.storage_offset()
        return self.error[index][at:at + grad.numel()].view_as(grad)

    def _split(self, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Gradients viewed as (rows, rest) matrices worth compressing, and the others as they are."""
        matrices, rest = [], []
        for g in grads:
            if g.dim() > 1:
                m = g.view(g.shape[0], -1)
                r = min(self.config.rank, *m.shape)
                if m.numel() >= 2 * (m.shape[0] + m.shape[1]) * r:  # at least half the bytes saved, as torch's hook
                    matrices.append(m)
                    continue
            rest.append(g)
        return matrices, rest

    def _factors(self, index: int, matrices: list[torch.Tensor], like: torch.Tensor) -> list[torch.Tensor]:
        """Each matrix's Q^T to start from: last step's (warm start), orthonormalized, or random."""
        qts = self.factors.get(index) if self.config.warm_start else None
        if qts is not None:
            for qt in qts:
                qt.copy_(_orthonormal(qt.t()).t())
            return qts
        qts = []
        for m in matrices:
            r = min(self.config.rank, *m.shape)
            q = torch.randn(m.shape[1], r, generator=self._rng).to(like)
            qts.append(_orthonormal(q).t().contiguous())
        self.factors[index] = qts
        return qts


def powersgd_hook(state, bucket):  # annotations omitted: DDP checks them literally
    """The DDP comm hook; ``state`` is the ``PowerSGDHook`` that keeps the factors and errors."""
    return state.reduce(bucket)


def _orthonormal(columns: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of these columns' span (QR: no division by zero when a column vanishes)."""
    return torch.linalg.qr(columns).Q


Compression = Union[str, PowerSGD, None]
COMPRESSIONS: dict[str, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
NAMES = (*COMPRESSIONS, "powersgd", "auto")


def check_compression(compression: Compression) -> None:
    """Refuse an unknown choice in one line, when the strategy is built."""
    if compression is None or isinstance(compression, PowerSGD) or compression in NAMES:
        return
    raise ValueError(
        f"unknown gradient compression {compression!r}; use one of {', '.join(NAMES)}, "
        "or loom.comm.PowerSGD(rank=..., error_feedback=...)"
    )


def compression_hook(compression: Compression, group: Any = None) -> tuple[Hook, Any] | None:
    """The DDP comm hook and its state for ``compression`` (None for plain fp32 all-reduce)."""
    check_compression(compression)
    if compression == "auto":
        raise ValueError("compression='auto' is resolved by choose_compression() before a hook is built")
    if compression == "powersgd":
        compression = PowerSGD()
    if isinstance(compression, PowerSGD):
        return compression.hook(group)
    dtype = COMPRESSIONS[compression or "none"]
    return None if dtype is None else (cast_allreduce_hook(dtype), None)


# ---- compression="auto" --------------------------------------------------------------------------
# Communication a step can leave exposed, in seconds. DDP overlaps the all-reduce with the
# backward pass; beyond this a step's time is the link's, and compression pays for its casts.
STEP_BUDGET = 0.05
DILOCO_SUGGESTION = 10  # PowerSGD still over budget by this factor: only syncing less often helps


@dataclass(frozen=True)
class Choice:
    name: str  # "none", "bf16" or "powersgd"
    line: str  # what was picked and why, one line


def ring_seconds(nbytes: float, bandwidth: float, world: int) -> float:
    """A ring all-reduce sends and receives 2(N-1)/N of the buffer through each link."""
    return 2 * (world - 1) / world * nbytes / bandwidth


def choose_compression(
    shapes: list[torch.Size], bandwidth: float, world: int, budget: float = STEP_BUDGET, powersgd: PowerSGD = PowerSGD()
) -> Choice:
    """The lightest compression whose all-reduce of these gradients fits ``budget`` seconds.

    ``bandwidth`` is the measured link speed in bytes/s. When even PowerSGD stays far over
    budget, the line suggests DiLoCoStrategy, which syncs every H steps instead of every step.
    """
    fp32 = sum(int(torch.Size(s).numel()) for s in shapes) * 4
    times = {
        "none": ring_seconds(fp32, bandwidth, world) if world > 1 else 0.0,
        "bf16": ring_seconds(fp32 / 2, bandwidth, world) if world > 1 else 0.0,
        "powersgd": ring_seconds(powersgd.compressed_bytes(shapes), bandwidth, world) if world > 1 else 0.0,
    }
    name = next((n for n in ("none", "bf16") if times[n] <= budget), "powersgd")
    facts = ", ".join(f"{n} {t * 1e3:.0f} ms" for n, t in times.items())
    line = (
        f"loom: compression='auto' picked {name}: {fp32 / 2**20:.1f} MiB of fp32 gradients per step over a "
        f"{bandwidth * 8 / 1e9:.2f} Gbit/s link take {facts} (budget {budget * 1e3:.0f} ms)"
    )
    if times["powersgd"] > DILOCO_SUGGESTION * budget:
        line += "; DiLoCoStrategy(sync_every=H) would sync 1/H as often"
    return Choice(name, line)


def measure_bandwidth(group: Any = None, nbytes: int = 4 * 2**20, repeats: int = 3) -> float:
    """Bytes/s through this replica's link, from timed all-reduces of ``nbytes`` (the median)."""
    world = dist.get_world_size(group)
    buffer = torch.zeros(nbytes // 4)
    dist.all_reduce(buffer, group=group)  # connections up before timing
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        times.append(time.perf_counter() - start)
    seconds = torch.tensor(sorted(times)[len(times) // 2])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)  # every replica decides the same
    return 2 * (world - 1) / world * nbytes / max(float(seconds), 1e-9)
