"""Gradient compression for the all-reduce, as DDP communication hooks, and the choice among them.

Kept apart from the strategies (like tf.distribute's CrossDeviceOps): a strategy takes the
choice as an argument. Three ways to send a step's gradients:

- ``"bf16"`` / ``"fp16"``: each bucket cast down, pre-divided by the group size (so the sum
  stays in range), reduced, and cast back into the fp32 gradients: half the bytes. DDP's own
  ``bf16_compress_hook`` refuses to run without CUDA and NCCL, although gloo reduces bf16 on
  CPU, hence a hook of our own.
- ``"powersgd"`` (or a ``PowerSGD(...)``): torch's ``powerSGD_hook``, a rank-r approximation of
  every gradient matrix with error feedback; a few percent of the bytes.
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
    """PowerSGD gradient compression (Vogels et al., 2019), run by torch's ``powerSGD_hook``.

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
                "(torch's hook needs one uncompressed step to size their buffers)"
            )

    def hook(self, group: Any = None) -> tuple[Hook, Any]:
        """The DDP hook and the state it keeps (error feedback, warm-start factors, step count)."""
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd  # lazy: only when chosen

        state = psgd.PowerSGDState(
            group,
            matrix_approximation_rank=self.rank,
            start_powerSGD_iter=self.start_iter,
            use_error_feedback=self.error_feedback,
            warm_start=self.warm_start,
            min_compression_rate=2,
        )
        return psgd.powerSGD_hook, state

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
