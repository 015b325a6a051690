"""One verdict from every rank's step breakdown: what bounds the job, by how much, and the fixes worth making.

Checked in this order, because each explains the ones after it: a straggler makes the others
wait in the all-reduce (their "communication"), and a rank waiting for input is not computing.

- straggler-bound: one rank's time outside communication exceeds the median of the others
  by a quarter and by a tenth of the step;
- input-bound: ranks wait for their next batch more than a tenth of the step
  (``loom.data.report.INPUT_BOUND``) and longer than for communication;
- communication-bound: a quarter of the step waits for the gradient reduction after compute;
  the wait is split into transfer (bytes over the measured all-reduce rate), latency (one
  measured round trip per bucket beyond the first) and the rest (a slower peer, the comm hook);
- compute-bound: half of the step is forward and backward.

A fix is advised only when its predicted gain is at least ``MIN_GAIN`` of the step, and the
gain is printed beside it; a fix whose gain cannot be predicted is not advised. Fixes fit the
device: bf16 is advised on a GPU's tensor cores or a CPU with bf16 matrix units, not elsewhere.
The verdict holds from one report to the next (``previous``) while its own measure stays above
``HOLD`` of its threshold, so numbers that move within noise do not flip it.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from loom.data.report import INPUT_BOUND

STRAGGLER_RATIO = 1.25  # busy time over the others' median
STRAGGLER_SHARE = 0.10  # ... and by this share of the step at least
COMM_BOUND = 0.25
COMPUTE_BOUND = 0.50
SPARSE_SHARE = 0.5  # embedding tables' share of the gradient bytes for parameter servers to help
MIN_GAIN = 0.10  # a fix is advised only when it is predicted to save this share of the step
HOLD = 0.8  # the verdict in force stays while its measure is above this share of its threshold
BF16_SPEEDUP = 2.0  # forward and backward in bf16 on tensor cores or AMX, against fp32
ACCUMULATE = 4  # the accumulation advised: a 4x global batch, one all-reduce per 4x the samples
BUCKET_MB = 25.0  # DDP's default bucket, the larger bucket advised


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
    latency: float | None = None  # measured seconds of a tiny all-reduce, when communication matters
    precision: str = "32"
    compression: str | None = None
    bucket_cap_mb: float | None = None
    input_summary: dict[str, Any] | None = None  # loom.data's InputStats.summary(), when the loader has one
    device: str = "cpu"  # the device type the replicas compute on
    bf16_units: bool | None = None  # the CPU has bf16 matrix units (AMX, AVX512-BF16); None: read /proc/cpuinfo


@dataclass
class Fix:
    """A change and the seconds per step it is predicted to save."""

    text: str
    seconds: float


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


def decide(ranks: list[RankTimes], facts: JobFacts, previous: str | None = None) -> Verdict:
    """The verdict for a job whose ranks took ``ranks``' times per step; ``previous`` is the last
    report's kind, kept while its measure stays above ``HOLD`` of its threshold."""
    ranks = [r for r in ranks if r.steps > 0]
    if not ranks:
        return Verdict("no steps", "no training steps were recorded since the last report")
    share = {part: statistics.median(r.seconds[part] / r.total for r in ranks if r.total) for part in ("input", "compute", "comm")}
    step = statistics.median(r.total for r in ranks)
    slow = max(ranks, key=lambda r: r.busy)
    others = statistics.median(r.busy for r in ranks if r is not slow) if len(ranks) > 1 else slow.busy
    checks: dict[str, tuple[Callable[[float], bool], Callable[[], Verdict]]] = {
        "straggler-bound": (
            lambda k: len(ranks) > 1 and slow.busy > (1 + (STRAGGLER_RATIO - 1) * k) * others and slow.busy - others > k * STRAGGLER_SHARE * step,
            lambda: _straggler(slow, ranks, others, step),
        ),
        "input-bound": (lambda k: share["input"] > k * INPUT_BOUND and share["input"] >= share["comm"], lambda: _input(share["input"], step, facts)),
        "communication-bound": (lambda k: share["comm"] > k * COMM_BOUND, lambda: _communication(share["comm"], step, facts)),
        "compute-bound": (lambda k: share["compute"] > k * COMPUTE_BOUND, lambda: _compute(share["compute"], step, facts)),
    }
    if previous in checks and checks[previous][0](HOLD):
        return checks[previous][1]()
    for holds, verdict in checks.values():
        if holds(1.0):
            return verdict()
    parts = ", ".join(f"{p} {share[p]:.0%}" for p in share)
    return Verdict("balanced", f"balanced: no single part bounds the {_ms(step)} step ({parts})")


def _advice(fixes: list[Fix], step: float, otherwise: str = "") -> str:
    """The fixes predicted to save ``MIN_GAIN`` of the step, each with its gain; or why there are none."""
    worth = sorted((f for f in fixes if f.seconds >= MIN_GAIN * step), key=lambda f: -f.seconds)
    if not worth:
        return f"No fix is predicted to save {MIN_GAIN:.0%} of the step{otherwise}"
    return "Fix: " + "; ".join(f"{f.text} (predicted gain {_ms(f.seconds)}, {f.seconds / step:.0%} of the step)" for f in worth)


def _straggler(slow: RankTimes, ranks: list[RankTimes], others: float, step: float) -> Verdict:
    excess = slow.busy - others
    median_parts = {p: statistics.median(r.seconds[p] for r in ranks if r is not slow) for p in ("input", "compute", "optimizer", "other")}
    worst = max(median_parts, key=lambda p: slow.seconds[p] - median_parts[p])
    fix = Fix(f"check host {slow.host}'s load and devices (other jobs, thermal limits, a slower device), or give rank {slow.rank} less work", excess)
    return Verdict(
        "straggler-bound",
        f"straggler-bound: rank {slow.rank} (host {slow.host}) is busy {_ms(slow.busy)} per step, {_ms(excess)} "
        f"(+{excess / others:.0%}) more than the median of the other ranks ({_ms(others)}), mostly in {worst} "
        f"({_ms(slow.seconds[worst])} against {_ms(median_parts[worst])}); the others wait for it in every "
        f"synchronisation. {_advice([fix], step)}",
        rank=slow.rank,
    )


def _input(share: float, step: float, facts: JobFacts) -> Verdict:
    summary = facts.input_summary
    wait = share * step
    head = f"input-bound: ranks wait {share:.0%} of each {_ms(step)} step ({_ms(wait)}) for their next batch"
    if summary and summary.get("batches"):
        stage = summary["slowest_stage"]
        seconds = summary["stage_seconds_per_batch"][stage]
        fix = summary["suggestion"] or "make that stage cheaper or run it in more workers (map(num_parallel=...))"
        return Verdict("input-bound", f"{head}; the slowest stage is '{stage}' ({_ms(seconds)} per batch). {_advice([Fix(fix, wait)], step)}")
    fix = Fix(
        "read batches in worker processes (distribute(..., num_workers=N) or a DataLoader with num_workers), or build "
        "the input as a loom.data pipeline, whose report names the slowest stage",
        wait,
    )
    return Verdict("input-bound", f"{head}. {_advice([fix], step)}")


def _communication(share: float, step: float, facts: JobFacts) -> Verdict:
    wait = share * step
    head = f"communication-bound: {share:.0%} of each {_ms(step)} step ({_ms(wait)}) waits for the gradient reduction after compute ends"
    wire = facts.grad_bytes * (0.5 if facts.compression else 1.0)
    transfer = min(wire / facts.bandwidth, wait) if facts.bandwidth else None
    messages = math.ceil(facts.grad_bytes / (facts.bucket_cap_mb * 2**20)) if facts.bucket_cap_mb and facts.grad_bytes else 1
    latency = min((messages - 1) * facts.latency, wait - (transfer or 0.0)) if facts.latency else None
    if transfer is not None:
        head += f"; it all-reduces {size(wire)} per step: {_ms(transfer)} at the rate measured for that size, {size(facts.bandwidth)}/s"
    if latency:
        head += f", and {messages} buckets cost {_ms(latency)} more in round trips of {_ms(facts.latency)}"
    rest = wait - (transfer or 0.0) - (latency or 0.0)
    otherwise = ""
    if transfer is not None and rest > 0.5 * wait:
        head += f"; the other {_ms(rest)} is waiting for a slower peer or the comm hook"
        otherwise = ": the wait is mostly not the transfer"
    fixes = []
    if transfer is not None and facts.grad_bytes and facts.embedding_bytes / facts.grad_bytes > SPARSE_SHARE:
        fixes.append(Fix(
            f"embedding tables are {facts.embedding_bytes / facts.grad_bytes:.0%} of the gradient: ParameterServerStrategy "
            "moves only the rows a batch touches", transfer * facts.embedding_bytes / facts.grad_bytes,
        ))  # fmt: skip
    if transfer is not None and not facts.compression:
        fixes.append(Fix("compression='bf16' halves the bytes", transfer / 2))
    if latency and facts.bucket_cap_mb is not None and facts.bucket_cap_mb < BUCKET_MB:
        fewer = math.ceil(facts.grad_bytes / (BUCKET_MB * 2**20))
        fixes.append(Fix(f"bucket_cap_mb={BUCKET_MB:g} (now {facts.bucket_cap_mb:g}) sends {fewer} bucket(s), not {messages}", (messages - fewer) * facts.latency))
    if transfer is not None:
        fixes.append(Fix(
            f"a {ACCUMULATE}x global batch through train_step(..., accumulate={ACCUMULATE}) all-reduces once per "
            f"{ACCUMULATE}x the samples (per today's batch)", (1 - 1 / ACCUMULATE) * (transfer + (latency or 0.0)),
        ))  # fmt: skip
    return Verdict("communication-bound", f"{head}. {_advice(fixes, step, otherwise)}")


def _compute(share: float, step: float, facts: JobFacts) -> Verdict:
    compute = share * step
    head = f"compute-bound: forward and backward take {share:.0%} of each {_ms(step)} step"
    fixes = []
    units = {"cuda": "tensor cores"}.get(facts.device) or ("this CPU's bf16 matrix units (AMX/AVX512-BF16)" if _bf16_units(facts) else None)
    if facts.precision == "32" and units:
        fixes.append(Fix(f"precision='bf16-mixed' runs forward and backward in bfloat16 on {units}", compute * (1 - 1 / BF16_SPEEDUP)))
    otherwise = "" if facts.precision != "32" or units else ": this CPU has no bf16 matrix units, so bf16-mixed would not be faster"
    return Verdict("compute-bound", f"{head}. {_advice(fixes, step, otherwise)}")


def _bf16_units(facts: JobFacts) -> bool:
    return facts.bf16_units if facts.bf16_units is not None else cpu_has_bf16_units()


@functools.cache
def cpu_has_bf16_units() -> bool:
    """Whether this CPU computes bf16 matrix products in hardware (AMX or AVX512-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags
