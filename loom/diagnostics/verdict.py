"""One verdict from every rank's step breakdown: what bounds the job, by how much, and the fix.

Checked in this order, because each explains the ones after it: a straggler makes the others
wait in the all-reduce (their "communication"), and a rank waiting for input is not computing.

- straggler-bound: one rank's time outside communication exceeds the median of the others
  by a quarter and by a tenth of the step;
- input-bound: ranks wait for their next batch more than a tenth of the step
  (``loom.data.report.INPUT_BOUND``) and longer than for communication;
- communication-bound: a quarter of the step waits for the gradient reduction after compute;
- compute-bound: half of the step is forward and backward.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from loom.data.report import INPUT_BOUND

STRAGGLER_RATIO = 1.25  # busy time over the others' median
STRAGGLER_SHARE = 0.10  # ... and by this share of the step at least
COMM_BOUND = 0.25
COMPUTE_BOUND = 0.50
SPARSE_SHARE = 0.5  # embedding tables' share of the gradient bytes for parameter servers to help


@dataclass
class RankTimes:
    """One rank's mean seconds per step of each part (``loom.diagnostics.breakdown.PARTS``)."""

    rank: int
    host: str
    seconds: dict[str, float]
    steps: int
    samples: int

    @property
    def total(self) -> float:
        return self.seconds["total"]

    @property
    def busy(self) -> float:
        """Time not spent waiting for the other ranks."""
        return self.total - self.seconds["comm"]


@dataclass
class JobFacts:
    """What the fixes depend on, beyond the timings."""

    grad_bytes: int = 0
    embedding_bytes: int = 0
    bandwidth: float | None = None  # measured all-reduce bytes/s, when communication matters
    precision: str = "32"
    compression: str | None = None
    bucket_cap_mb: float | None = None
    input_summary: dict[str, Any] | None = None  # loom.data's InputStats.summary(), when the loader has one


@dataclass
class Verdict:
    kind: str  # straggler-bound, input-bound, communication-bound, compute-bound, balanced, no steps
    message: str
    rank: int | None = None  # the straggler

    def __str__(self) -> str:
        return f"verdict: {self.message}"


def size(n: float) -> str:
    """Bytes as a person reads them: 1.2 GB, 3.4 MB, 5.6 KB, 78 bytes."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} bytes"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def decide(ranks: list[RankTimes], facts: JobFacts) -> Verdict:
    """The verdict for a job whose ranks took ``ranks``' times per step."""
    ranks = [r for r in ranks if r.steps > 0]
    if not ranks:
        return Verdict("no steps", "no training steps were recorded since the last report")
    share = {part: statistics.median(r.seconds[part] / r.total for r in ranks if r.total) for part in ("input", "compute", "comm")}
    step = statistics.median(r.total for r in ranks)
    if len(ranks) > 1:
        slow = max(ranks, key=lambda r: r.busy)
        others = statistics.median(r.busy for r in ranks if r is not slow)
        if slow.busy > STRAGGLER_RATIO * others and slow.busy - others > STRAGGLER_SHARE * step:
            return _straggler(slow, ranks, others)
    if share["input"] > INPUT_BOUND and share["input"] >= share["comm"]:
        return _input(share["input"], step, facts)
    if share["comm"] > COMM_BOUND:
        return _communication(share["comm"], step, len(ranks), facts)
    if share["compute"] > COMPUTE_BOUND:
        return _compute(share["compute"], step, facts)
    parts = ", ".join(f"{p} {share[p]:.0%}" for p in share)
    return Verdict("balanced", f"balanced: no single part bounds the {_ms(step)} step ({parts})")


def _straggler(slow: RankTimes, ranks: list[RankTimes], others: float) -> Verdict:
    excess = slow.busy - others
    median_parts = {p: statistics.median(r.seconds[p] for r in ranks if r is not slow) for p in ("input", "compute", "optimizer", "other")}
    worst = max(median_parts, key=lambda p: slow.seconds[p] - median_parts[p])
    return Verdict(
        "straggler-bound",
        f"straggler-bound: rank {slow.rank} (host {slow.host}) is busy {_ms(slow.busy)} per step, {_ms(excess)} "
        f"(+{excess / others:.0%}) more than the median of the other ranks ({_ms(others)}), mostly in {worst} "
        f"({_ms(slow.seconds[worst])} against {_ms(median_parts[worst])}); the others wait for it in every "
        "synchronisation. Fix: check that host's load and devices (other jobs, thermal limits, a slower device), "
        "or give it less work",
        rank=slow.rank,
    )


def _input(share: float, step: float, facts: JobFacts) -> Verdict:
    summary = facts.input_summary
    head = f"input-bound: ranks wait {share:.0%} of each {_ms(step)} step for their next batch"
    if summary and summary.get("batches"):
        stage = summary["slowest_stage"]
        seconds = summary["stage_seconds_per_batch"][stage]
        fix = summary["suggestion"] or "make that stage cheaper or run it in more workers (map(num_parallel=...))"
        return Verdict("input-bound", f"{head}; the slowest stage is '{stage}' ({_ms(seconds)} per batch). Fix: {fix}")
    return Verdict(
        "input-bound",
        f"{head}. Fix: read batches in worker processes (distribute(..., num_workers=N) or a DataLoader with "
        "num_workers), or build the input as a loom.data pipeline, whose report names the slowest stage",
    )


def _communication(share: float, step: float, replicas: int, facts: JobFacts) -> Verdict:
    wire = facts.grad_bytes * (0.5 if facts.compression else 1.0)
    head = f"communication-bound: {share:.0%} of each {_ms(step)} step ({_ms(share * step)}) waits for the gradient reduction after compute ends"
    if facts.bandwidth:
        expected = wire / facts.bandwidth
        head += (
            f"; it all-reduces {size(wire)} per step, {_ms(expected)} at the all-reduce rate measured for that size, {size(facts.bandwidth)}/s"
        )
        if expected < 0.5 * share * step:
            head += " (the rest is latency, a slow peer or the comm hook)"
    fixes = []
    if facts.grad_bytes and facts.embedding_bytes / facts.grad_bytes > SPARSE_SHARE:
        fixes.append(
            f"embedding tables are {facts.embedding_bytes / facts.grad_bytes:.0%} of the gradient: ParameterServerStrategy "
            "moves only the rows a batch touches"
        )
    if not facts.compression:
        fixes.append("compression='bf16' halves the bytes")
    if facts.bucket_cap_mb is not None and facts.grad_bytes > facts.bucket_cap_mb * 2**20:
        fixes.append(f"a larger bucket_cap_mb (now {facts.bucket_cap_mb:g}) sends fewer, larger messages")
    fixes.append("train_step(..., accumulate=k) synchronises once per k micro-batches")
    return Verdict("communication-bound", f"{head}. Fix: " + "; ".join(fixes))


def _compute(share: float, step: float, facts: JobFacts) -> Verdict:
    if facts.precision == "32":
        fix = "precision='bf16-mixed' runs forward and backward in bfloat16 (about twice as fast on tensor cores)"
    else:
        fix = f"already {facts.precision}: torch.compile the model, or add devices (the step scales with them)"
    return Verdict("compute-bound", f"compute-bound: forward and backward take {share:.0%} of each {_ms(step)} step. Fix: {fix}")
