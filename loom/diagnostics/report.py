"""The breakdown of every rank in one place: a table, TensorBoard scalars, a PNG, and the verdict.

``report`` is collective: every replica calls it at the same point (``fit`` at each epoch's
end, or ``strategy.report()``). One all-gather brings every rank's mean times to all of them,
so every rank reaches the same verdict, and the decision to probe the link's bandwidth (one
more collective, only when communication matters) is taken alike everywhere.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from loom.diagnostics.breakdown import PARTS, batch_size_of
from loom.diagnostics.verdict import COMM_BOUND, MIN_GAIN, JobFacts, RankTimes, Verdict, decide

HOST_BYTES = 64
PROBE_BYTES = 8 * 2**20  # the bandwidth probe all-reduces up to this much (or the gradients' size)


# The marks are host clock readings; an accelerator runs its queued work after the host moves on.
HOST_TIMED = Verdict(
    "host-timed",
    "no verdict: these are host times, and the device runs its queued kernels asynchronously, so they do not "
    "say where the device's time goes (device timing is not built yet)",
)


@dataclass
class BreakdownReport:
    """Every rank's mean seconds per step, the verdict, and the measured all-reduce bandwidth."""

    ranks: list[RankTimes]
    verdict: Verdict
    bandwidth: float | None
    samples_per_sec: float
    changed: bool = True  # the verdict's kind differs from the previous report's

    def table(self, title: str = "step breakdown") -> str:
        steps = min((r.steps for r in self.ranks), default=0)
        width = max([4] + [len(r.host) for r in self.ranks])
        lines = [f"{title}: {steps} step(s) per rank, ms per step, {self.samples_per_sec:,.0f} samples/s"]
        lines.append(f"{'rank':>4}  {'host':<{width}}" + "".join(f"{p:>10}" for p in (*PARTS, "total")))
        for r in self.ranks:
            lines.append(f"{r.rank:>4}  {r.host:<{width}}" + "".join(f"{r.seconds[p] * 1e3:>10.2f}" for p in (*PARTS, "total")))
        lines.append(str(self.verdict))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": [asdict(r) for r in self.ranks],
            "verdict": asdict(self.verdict),
            "bandwidth_bytes_per_sec": self.bandwidth,
            "samples_per_sec": self.samples_per_sec,
        }


def report(
    strategy: Any, loader: Any = None, log_dir: str | None = None, step: int | None = None, show: bool = True
) -> BreakdownReport:
    """Gather, decide, and on the chief print (``show``) and write to ``log_dir``; starts a new window.

    The previous report's verdict holds while its measure stays near its threshold
    (``loom.diagnostics.verdict.HOLD``): the recorder keeps it from one report to the next."""
    recorder = strategy.step_recorder
    ranks = _gather(strategy, recorder)
    bucket_cap_mb = getattr(strategy, "bucket_cap_mb", None)  # "auto" is already sized from the model
    facts = JobFacts(
        grad_bytes=recorder.grad_bytes,
        embedding_bytes=recorder.embedding_bytes,
        precision=strategy.precision.name,
        compression=getattr(strategy, "compression", None),
        bucket_cap_mb=bucket_cap_mb if isinstance(bucket_cap_mb, (int, float)) else None,
        input_summary=loader.stats.summary() if getattr(loader, "stats", None) is not None else None,
        device=strategy.device.type,
    )
    if _comm_matters(ranks):
        facts.bandwidth = bandwidth(strategy, recorder.grad_bytes)
        facts.latency = latency(strategy)
    verdict = decide(ranks, facts, recorder.verdict_kind) if strategy.device.type == "cpu" else HOST_TIMED
    result = BreakdownReport(ranks, verdict, facts.bandwidth, _throughput(ranks), changed=verdict.kind != recorder.verdict_kind)
    if verdict.kind != "no steps":
        recorder.verdict_kind = verdict.kind
    recorder.reset()
    if strategy.is_chief:
        if show:
            print(result.table(), flush=True)
        if log_dir is not None:
            write(result, Path(log_dir), step)
    return result


def mention_advice(strategy: Any, model: Any, inputs: Any, result: BreakdownReport) -> None:
    """At the end of a run: the chief says so when ``loom.advise`` recommends another strategy that
    its cost model predicts to save ``MIN_GAIN`` of the measured step, the gain beside it; collective.

    The facts come from the run: the measured compute per step, the link measured between the
    replicas, and ``inputs`` (the last batch) for the activations and embedding rows.
    """
    from loom.diagnostics.advise import advise, describe

    counted = [r.seconds["compute"] for r in result.ranks if r.steps]
    if strategy.num_replicas_in_sync < 2 or not counted or not batch_size_of(inputs) or result.verdict is HOST_TIMED:
        return
    advice = advise(model, (inputs,), strategy=strategy, compute_seconds=statistics.median(counted))
    current = next((o for o in advice.options if o.strategy == describe(strategy)), None)
    best = next(o for o in advice.options if o.strategy == advice.recommendation)
    step = statistics.median(r.total for r in result.ranks if r.steps)
    # the cost model's own figure for the strategy in use where it has one, else the measured step
    gain = (current.step_seconds if current is not None else step) - best.step_seconds
    if strategy.is_chief and best is not current and gain >= MIN_GAIN * step:
        print(
            f"advice: {advice.recommendation} rather than {describe(strategy)} (predicted gain {gain * 1e3:.1f} ms, "
            f"{gain / step:.0%} of the step). {advice.reasons}",
            flush=True,
        )


def _gather(strategy: Any, recorder: Any) -> list[RankTimes]:
    means = recorder.means()
    host = recorder.host.encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
    row = [means[p] for p in (*PARTS, "total")] + [recorder.steps, recorder.samples] + list(host)
    rows = strategy.gather(torch.tensor([row], dtype=torch.float64, device=strategy.device)).cpu().tolist()
    n = len(PARTS) + 1
    return [
        RankTimes(
            rank=i,
            host=bytes(int(b) for b in values[n + 2 :]).rstrip(b"\0").decode(errors="replace"),
            seconds=dict(zip((*PARTS, "total"), values[:n])),
            steps=int(values[n]),
            samples=int(values[n + 1]),
        )
        for i, values in enumerate(rows)
    ]


def _comm_matters(ranks: list[RankTimes]) -> bool:
    counted = [r for r in ranks if r.steps and r.total]
    return len(ranks) > 1 and bool(counted) and statistics.median(r.seconds["comm"] / r.total for r in counted) > COMM_BOUND


def _throughput(ranks: list[RankTimes]) -> float:
    return sum(r.samples / (r.steps * r.total) for r in ranks if r.steps and r.total)


def bandwidth(strategy: Any, size: int) -> float | None:
    """All-reduce bytes/s between the replicas for a message like the gradients (capped); collective."""
    if strategy.num_replicas_in_sync < 2:
        return None
    tensor = torch.ones(max(min(size, PROBE_BYTES) // 4, 1024), device=strategy.device)
    seconds = []
    for i in range(4):
        start = time.perf_counter()
        float(strategy.reduce(tensor, "sum")[0])  # reading it waits for the device
        if i:  # the first sets the connection up
            seconds.append(time.perf_counter() - start)
    return tensor.numel() * 4 / statistics.median(seconds)


def latency(strategy: Any) -> float:
    """Seconds of an all-reduce of one float between the replicas (a round trip); collective."""
    tensor = torch.ones(1, device=strategy.device)
    seconds = []
    for i in range(4):
        start = time.perf_counter()
        float(strategy.reduce(tensor, "sum")[0])
        if i:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def write(result: BreakdownReport, log_dir: Path, step: int | None = None) -> None:
    """Into ``log_dir/breakdown`` (TensorBoard shows it as a run of its own, beside the training's):
    scalars (ms per step of each part, per rank), the verdict as text, the JSON and a PNG."""
    from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where used

    log_dir = log_dir / "breakdown"
    log_dir.mkdir(parents=True, exist_ok=True)
    with SummaryWriter(str(log_dir)) as writer:
        for r in result.ranks:
            for part in (*PARTS, "total"):
                writer.add_scalar(f"breakdown/rank{r.rank}/{part}_ms", r.seconds[part] * 1e3, step)
        writer.add_text("breakdown/verdict", result.verdict.message, step)
    suffix = "" if step is None else f"-{step}"
    (log_dir / f"breakdown{suffix}.json").write_text(json.dumps(result.to_dict(), indent=2))
    try:
        plot(result, log_dir / f"breakdown{suffix}.png")
    except ImportError:
        print("loom: the breakdown's PNG needs matplotlib: pip install matplotlib", flush=True)


def plot(result: BreakdownReport, path: Path) -> Path:
    """Stacked bars per rank, one colour per part, the verdict as the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 1.0 + 0.6 * len(result.ranks)), 4.0))
    labels = [f"{r.rank}\n{r.host[:12]}" for r in result.ranks]
    bottom = [0.0] * len(result.ranks)
    for part in PARTS:
        values = [r.seconds[part] * 1e3 for r in result.ranks]
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("rank")
    ax.set_ylabel("ms per step")
    ax.set_title(result.verdict.kind, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
