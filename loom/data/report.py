"""Where input time goes, and a verdict: is the training loop waiting for its data?

Workers time each stage of each batch (read, every map, collate); the loader times how long
the training loop waited in ``next()`` and how long it spent between batches (the step). The
first batch's wait is start-up and is reported apart. A job is input-bound when waiting takes
more than a tenth of the loop's time; the suggestion then follows from which limit was hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

INPUT_BOUND = 0.10  # waiting for input above this share of the loop's time


@dataclass
class InputStats:
    stages: list[str]
    workers: int
    method: str
    prefetch: int
    cached: bool
    batches: int = 0
    stage_seconds: list[float] = field(init=False)
    startup_seconds: float | None = None
    wait_seconds: float = 0.0
    waits: int = 0
    step_seconds: float = 0.0
    steps: int = 0

    def __post_init__(self) -> None:
        self.stage_seconds = [0.0] * len(self.stages)

    def record_batch(self, seconds: list[float], waited: float) -> None:
        for i, value in enumerate(seconds):
            self.stage_seconds[i] += value
        self.batches += 1
        if self.startup_seconds is None:
            self.startup_seconds = waited
        else:
            self.wait_seconds += waited
            self.waits += 1

    def record_step(self, seconds: float) -> None:
        self.step_seconds += seconds
        self.steps += 1

    @property
    def wait_fraction(self) -> float:
        """Share of the loop's time (after start-up) spent waiting for input."""
        total = self.wait_seconds + self.step_seconds
        return self.wait_seconds / total if total else 0.0

    def summary(self) -> dict[str, Any]:
        """Per-batch figures in seconds, the verdict and the suggestion, for JSON or a report."""
        per_batch = [s / max(self.batches, 1) for s in self.stage_seconds]
        work = sum(per_batch)
        slowest = self.stages[max(range(len(per_batch)), key=per_batch.__getitem__)]
        wait = self.wait_seconds / max(self.waits, 1)
        step = self.step_seconds / max(self.steps, 1)
        bound = self.waits > 0 and self.wait_fraction > INPUT_BOUND
        return {
            "batches": self.batches,
            "stage_seconds_per_batch": dict(zip(self.stages, per_batch)),
            "input_seconds_per_batch": work,
            "workers": self.workers,
            "input_seconds_per_batch_parallel": work / max(self.workers, 1),
            "step_seconds": step,
            "wait_seconds_per_step": wait,
            "wait_fraction": self.wait_fraction,
            "startup_seconds": self.startup_seconds or 0.0,
            "input_bound": bound,
            "slowest_stage": slowest,
            "suggestion": self._suggestion(slowest, work, step) if bound else "",
        }

    def _suggestion(self, slowest: str, work: float, step: float) -> str:
        from loom.devices import available_cores

        cores = available_cores()
        if self.workers == 0:
            return "the maps run in the training loop's thread: map(..., num_parallel='auto') runs them in parallel"
        if self.workers < cores:
            return f"raise map(num_parallel=...) from {self.workers} to {cores}, the cores this process has"
        if work / self.workers <= step:
            depth = max(2 * self.prefetch, 2 * self.workers)
            return f"the workers keep up on average but not at every step: prefetch({depth}) evens it out"
        advice = (
            f"the CPU is the limit ({work / self.workers * 1e3:.1f} ms of work per batch on {self.workers} workers, "
            f"{step * 1e3:.1f} ms per step)"
        )
        if not self.cached and self.method == "thread":
            advice += "; cache() after the maps whose output does not change between epochs"
        if self.method == "thread" and slowest not in ("read", "collate"):
            advice += f"; if '{slowest}' is pure Python, map(..., method='process') sidesteps the GIL"
        return advice + f"; or make '{slowest}' cheaper (do it once, offline)"

    def report(self) -> str:
        s = self.summary()
        lines = [f"input pipeline: {s['batches']} batches, {self.workers} {self.method} worker(s), prefetch {self.prefetch}"]
        for stage, seconds in s["stage_seconds_per_batch"].items():
            mark = "  <- slowest" if stage == s["slowest_stage"] else ""
            lines.append(f"  {stage:<16} {seconds * 1e3:9.2f} ms/batch{mark}")
        lines.append(
            f"  {'all stages':<16} {s['input_seconds_per_batch'] * 1e3:9.2f} ms/batch, "
            f"{s['input_seconds_per_batch_parallel'] * 1e3:.2f} ms over {max(self.workers, 1)} worker(s)"
        )
        lines.append(
            f"  training step {s['step_seconds'] * 1e3:.2f} ms; waited {s['wait_seconds_per_step'] * 1e3:.2f} ms "
            f"per step for input ({s['wait_fraction']:.0%}); start-up {s['startup_seconds'] * 1e3:.0f} ms"
        )
        if s["input_bound"]:
            lines.append(f"verdict: input-bound, slowest stage '{s['slowest_stage']}': {s['suggestion']}")
        else:
            lines.append("verdict: not input-bound")
        return "\n".join(lines)
